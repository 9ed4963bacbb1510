"""DeepSpeed itself: the version range the glue was written against, and its JIT-built ops, built once.

DeepSpeedCPUAdam builds cpu_adam (about a minute on 2 cores); ZeRO-Infinity's NVMe offload builds async_io (3
minutes). On a CPU host deepspeed.init_distributed would also build deepspeed_shm_comm, which only DeepSpeed's
inference all-reduce uses: trainer3d skips it (skip_inference_shm_op). A run killed while building leaves a
`lock` file that makes every later run wait forever, and two different `ninja` binaries on PATH make torch
rebuild from scratch. So they are built here, once, into one per-checkout directory, with the PATH the runs have.
"""

from __future__ import annotations

import os
import sys

from trainer3d.errors import ConfigError
from trainer3d.private_api import require

# glue.py reaches into these DeepSpeed versions' internals; pyproject pins the same range.
DEEPSPEED_MIN, DEEPSPEED_BELOW = (0, 19, 8), (0, 20, 0)


def _version_tuple(v: str) -> tuple[int, ...]:
    parts = []
    for piece in v.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def check_deepspeed_version(version: str | None = None) -> str:
    """Refuse a DeepSpeed outside the range the glue was written and tested against."""
    if version is None:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version

        try:
            version = dist_version("deepspeed")
        except PackageNotFoundError:
            raise ConfigError(
                "--deepspeed_config needs DeepSpeed; install it with `pip install 'deepspeed>=0.19.8,<0.20'`."
            ) from None
    if not DEEPSPEED_MIN <= _version_tuple(version) < DEEPSPEED_BELOW:
        raise ConfigError(
            f"DeepSpeed {version} is not supported by trainer3d/zero/ (tested with >=0.19.8,<0.20, it patches "
            "DeepSpeed internals); install `deepspeed>=0.19.8,<0.20` or re-validate trainer3d/zero/glue.py against this version."
        )
    return version


DEBUG_FLAG = "-g"  # what build_without_debug_info takes out of DeepSpeed's compiler flags
OPS = ("CPUAdamBuilder", "AsyncIOBuilder")
OP_DIRS = {"CPUAdamBuilder": "cpu_adam", "AsyncIOBuilder": "async_io"}


def default_extensions_dir() -> str:
    """The per-checkout build directory (gitignored .cache/), unless TORCH_EXTENSIONS_DIR names another."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(root, ".cache", "torch_extensions")


def use_prebuilt_ops() -> str:
    """Point torch's JIT loader at the prebuilt directory (if TORCH_EXTENSIONS_DIR is unset); return it."""
    path = default_extensions_dir()
    os.environ["TORCH_EXTENSIONS_DIR"] = path
    return path


def build_without_debug_info() -> None:
    """DeepSpeed compiles its ops with -g, 23-40% of a CPU op's compile time (cpu_adam_impl.cpp: 52 -> 32 s of
    CPU) for debug info no run reads. trainer3d's processes build and load them without it, every one of them
    (zero/engine.prepare_deepspeed, build_ops): torch's JIT rebuilds an op whose flags changed. Idempotent."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    if getattr(OpBuilder.jit_load, "trainer3d_no_debug_info", False):
        return
    require("zero/ops.py")
    jit_load = OpBuilder.jit_load

    def load(self, verbose=True):
        cxx_args = self.cxx_args
        self.cxx_args = lambda: [a for a in cxx_args() if a != DEBUG_FLAG]
        return jit_load(self, verbose)

    load.trainer3d_no_debug_info = True
    OpBuilder.jit_load = load


def _built_with_debug_info(op_dir: str) -> bool:
    """An op built by DeepSpeed's own flags (a checkout's ops from before build_without_debug_info): its build.ninja
    (torch's JIT writes it) compiles with -g, so the next load would rebuild it."""
    try:
        with open(os.path.join(op_dir, "build.ninja")) as f:
            return any(line.startswith("cflags") and DEBUG_FLAG in line.split() for line in f)
    except OSError:
        return False


def skip_inference_shm_op() -> None:
    """DeepSpeed's communication backend builds and loads deepspeed_shm_comm on a CPU host (40 s of compiling on 2
    cores, a shared-memory segment per rank) for its inference all-reduce alone (module_inject's tensor-parallel
    layers), which trainer3d never calls: without the op, that all-reduce would fall back to torch.distributed's."""
    require("zero/ops.py")
    from importlib import import_module

    # (`import deepspeed.comm.torch as m` would bind the package's attribute `torch`: torch itself)
    import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def ops_needed(nvme: bool = False) -> list[str]:
    return ["CPUAdamBuilder"] + (["AsyncIOBuilder"] if nvme else [])


def missing_ops(names=None, path: str | None = None) -> list[str]:
    """Ops (builder names) whose shared library is not in the build directory yet, that a stale lock blocks, or
    that were built with other flags."""
    path = path or default_extensions_dir()
    out = []
    for name in names or ops_needed():
        d = os.path.join(path, OP_DIRS[name])
        if (not os.path.isfile(os.path.join(d, OP_DIRS[name] + ".so")) or os.path.exists(os.path.join(d, "lock"))
                or _built_with_debug_info(d)):
            out.append(name)
    return out


def aio_available() -> bool:
    """DeepSpeed's async_io op (ZeRO-Infinity) is prebuilt here, or libaio is present so it can be built."""
    if not missing_ops(["AsyncIOBuilder"]):
        return True
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("AsyncIOBuilder")
    return builder is not None and bool(builder.is_compatible(verbose=False))


def build_ops(names=OPS) -> dict[str, str]:
    """Build (or find already built) DeepSpeed's JIT ops into $TORCH_EXTENSIONS_DIR; name -> status.

    Builders of this checkout take an exclusive flock on the directory first. The kernel drops a flock when its
    holder dies, so a torch `lock` file found while holding it was left by a build that was killed half-way (torch
    would wait on it forever): it is removed and that op built again."""
    import fcntl
    import shutil
    import time

    path = use_prebuilt_ops()
    os.makedirs(path, exist_ok=True)
    build_without_debug_info()
    from deepspeed.accelerator import get_accelerator

    status = {}
    with open(os.path.join(path, ".trainer3d-build.lock"), "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # another test session or build of this checkout finishes first
        for name in names:
            builder = get_accelerator().create_op_builder(name)
            if builder is None:
                status[name] = "not used by this accelerator"
                continue
            if not builder.is_compatible(verbose=False):
                status[name] = "cannot be built here (" + (
                    "libaio headers missing: apt-get install libaio-dev" if name == "AsyncIOBuilder" else "incompatible"
                ) + ")"
                continue
            lock = os.path.join(path, OP_DIRS.get(name, builder.name), "lock")
            if os.path.exists(lock):
                os.remove(lock)
                print(f"[trainer3d] removed {lock}, left by a build that was killed", file=sys.stderr)
            t0 = time.time()
            builder.load(verbose=False)
            status[name] = f"ok ({time.time() - t0:.0f} s)"
    status["_dir"] = path
    status["_ninja"] = shutil.which("ninja") or "none"
    return status
