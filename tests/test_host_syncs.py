"""One device-to-host read per training step (issue 6): Trainer.train_step at (1,1,1) reads the device exactly once
from trainer3d code, under DDP (fp32, and fp16 with its loss scale and skip check) and under ZeRO stages (1, 3,
and 3 with the optimizer offloaded, whose norm comes from DeepSpeed's per-partition norms).

A CPU run has no device sync to count, so the test counts what would be one on an accelerator: the tensor methods
that copy a value to the host (item, tolist, cpu, numpy, and float()/int()/bool()/index of a tensor) called directly
from a file of the trainer3d package during one train_step (the second: the first also builds lazy state). The one
read is parallel/engine.py's read_scalars. DeepSpeed's own reads inside engine.step() are its own and not counted.
"""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch

from distributed import run_world
from parity import VOCAB, global_batches, parity_config

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "trainer3d") + os.sep
READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")


@contextlib.contextmanager
def count_reads():
    """Yields a list that collects 'file:line function' for every host read called from trainer3d code."""
    calls: list[str] = []
    saved = {name: torch.Tensor.__dict__.get(name) for name in READS}

    def wrap(name):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, **kwargs):
            caller = sys._getframe(1).f_code
            if caller.co_filename.startswith(PACKAGE):
                calls.append(f"{os.path.relpath(caller.co_filename, PACKAGE)}:{caller.co_name} .{name}")
            return original(self, *args, **kwargs)

        return counted

    for name in READS:
        setattr(torch.Tensor, name, wrap(name))
    try:
        yield calls
    finally:
        for name, value in saved.items():
            if value is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, value)


def _reads_per_step(rank: int, world_size: int, cases: dict) -> dict:
    from trainer3d.train.setup import validate
    from trainer3d.train.trainer import Trainer

    out = {}
    for name, kw in cases.items():
        cfg = parity_config(n_layer=2, **kw)
        setup = validate(cfg, 1, VOCAB)
        topo = setup.topology([0])
        trainer = Trainer(setup, topo, torch.device("cpu"), cfg.model_config(VOCAB))
        first, second = global_batches(2)
        trainer.train_step(first)
        with count_reads() as calls:
            record = trainer.train_step(second)
        out[name] = {"calls": calls, "record": record}
        topo.destroy()
    return out


def _ds(stage: int, offload: str = "none") -> dict:
    from test_zero import ds_config

    return ds_config(stage, offload)


def test_count_reads_sees_a_read():
    """The counter itself: a read from trainer3d code is seen, one from here is not."""
    from trainer3d.parallel.engine import read_scalars

    with count_reads() as calls:
        assert read_scalars(torch.tensor(2.0), torch.tensor(3.0, dtype=torch.float64)) == [2.0, 3.0]
        torch.tensor(1.0).item()
    assert calls == ["parallel/engine.py:read_scalars .tolist"]


def test_one_read_per_train_step_ddp():
    cases = {"ddp-fp32": {}, "ddp-fp16": {"precision": "fp16"}}
    results = run_world(1, _reads_per_step, cases, timeout=300)[0]
    for name, r in results.items():
        print(f"\n{name}: {r['calls']}")
        assert r["calls"] == ["parallel/engine.py:read_scalars .tolist"], f"{name}: {r['calls']}"
        assert r["record"]["loss"] > 0 and r["record"]["grad_norm"] > 0
    assert results["ddp-fp16"]["record"]["skipped"] is False


def test_one_read_per_train_step_zero():
    pytest.importorskip("deepspeed")
    from ds_ops import require_ops

    require_ops()
    cases = {"zero1": {"deepspeed_config": _ds(1)}, "zero3": {"deepspeed_config": _ds(3)},
             "zero3-offload-opt": {"deepspeed_config": _ds(3, "opt")}}
    results = run_world(1, _reads_per_step, cases, timeout=600)[0]
    for name, r in results.items():
        print(f"\n{name}: {r['calls']}")
        assert r["calls"] == ["parallel/engine.py:read_scalars .tolist"], f"{name}: {r['calls']}"
        assert r["record"]["loss"] > 0 and r["record"]["grad_norm"] > 0
