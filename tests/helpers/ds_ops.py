"""DeepSpeed's CPU ops for the tests: built once, by the first test that needs them, into the checkout's own
.cache/torch_extensions (trainer3d.zero.ops.build_ops: safe against a build killed half-way, reused by every later
run). A test skips, with the reason, only where this machine cannot build them (no compiler, no libaio); with
TRAINER3D_REQUIRE_DS_OPS=1 (CI) it fails instead."""

from __future__ import annotations

import os

import pytest

from trainer3d.zero import ops as zero_ops


def require_ops(nvme: bool = False) -> None:
    names = zero_ops.ops_needed(nvme=nvme)
    if zero_ops.missing_ops(names):
        status = zero_ops.build_ops(zero_ops.missing_ops(names))
        print(f"\n[tests] built DeepSpeed ops into {status.get('_dir')}: "
              + ", ".join(f"{k}: {v}" for k, v in status.items() if not k.startswith("_")))
    missing = zero_ops.missing_ops(names)
    if missing:
        msg = (f"DeepSpeed ops {missing} cannot be built on this machine into {zero_ops.default_extensions_dir()} "
               "(a C++ compiler, and libaio-dev for the NVMe op, are needed)")
        if os.environ.get("TRAINER3D_REQUIRE_DS_OPS"):
            pytest.fail(msg)
        pytest.skip(msg)


def nvme_op_available() -> bool:
    """DeepSpeed's async_io op (ZeRO-Infinity), built here once if libaio's headers are installed."""
    if zero_ops.missing_ops(["AsyncIOBuilder"]) and zero_ops.aio_available():
        zero_ops.build_ops(["AsyncIOBuilder"])
    return not zero_ops.missing_ops(["AsyncIOBuilder"])
