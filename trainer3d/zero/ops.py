"""DeepSpeed itself: the version range the glue was written against, and its JIT-built ops, built once.

DeepSpeedCPUAdam builds cpu_adam; ZeRO-Infinity's NVMe offload builds async_io and pin_memory (with
torch/extension.h reduced to torch/python.h and precompiled: LIGHT_TORCH_HEADER, PRECOMPILED; their build times:
docs/zero.md). On a CPU host deepspeed.init_distributed would also build deepspeed_shm_comm, which only DeepSpeed's inference all-reduce uses: trainer3d skips it
(skip_inference_shm_op). A run killed while building leaves a `lock` file that makes every later run wait forever, and
two different `ninja` binaries on PATH make torch rebuild from scratch. So they are built here, once, into one
per-checkout directory, with the PATH the runs have.
"""

from __future__ import annotations

import functools
import os
import sys

from trainer3d.errors import ConfigError
from trainer3d.fsio import write_text_atomic
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


DEBUG_FLAG = "-g"  # what op_build_flags takes out of DeepSpeed's compiler flags
# What op_build_flags adds: torch/extension.h then includes torch/python.h alone, not torch/all.h (the C++ frontend's
# optim, data, serialize, jit: no op of DeepSpeed's uses them). The macro is inductor's C++ wrapper's, and
# extension.h is the only torch header that reads it.
LIGHT_TORCH_HEADER = "-DTORCH_INDUCTOR_CPP_WRAPPER"
OPS = ("CPUAdamBuilder", "AsyncIOBuilder")
OP_DIRS = {"CPUAdamBuilder": "cpu_adam", "AsyncIOBuilder": "async_io"}
# Ops whose translation units each parse torch/extension.h (9 of async_io's 12, most of each one's compile time).
# They -include PCH_HEADER, which is written into the op's build directory (where ninja compiles: a relative path, so
# that a copy of the built ops stays built) and, before a build from scratch, precompiled there with the flags of the
# build.ninja torch wrote (GCC's .gch beside it, 600 MB, deleted after the build; GCC's dependency files do not list
# it). Units that include no torch header keep the flags less -include (_plain_units_without_header).
PRECOMPILED = ("async_io",)
PCH_HEADER = "trainer3d_torch_extension.h"
UNIT_CFLAGS = "  cflags = "  # a build statement's own flags in build.ninja (_plain_units_without_header)


def default_extensions_dir() -> str:
    """The per-checkout build directory (gitignored .cache/), unless TORCH_EXTENSIONS_DIR names another."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(root, ".cache", "torch_extensions")


def use_prebuilt_ops() -> str:
    """Point torch's JIT loader at the prebuilt directory (if TORCH_EXTENSIONS_DIR is unset); return it."""
    path = default_extensions_dir()
    os.environ["TORCH_EXTENSIONS_DIR"] = path
    return path


def op_build_flags() -> None:
    """The flags every trainer3d process builds and loads DeepSpeed's ops with (zero/engine.prepare_deepspeed,
    build_ops): torch's JIT rebuilds an op whose flags changed. DeepSpeed's less -g (23-40% of a CPU op's compile time,
    cpu_adam_impl.cpp: 52 -> 32 s of CPU, for debug info no run reads), plus LIGHT_TORCH_HEADER (the three ops from
    scratch: 225 -> 147 s of CPU) and PRECOMPILED ops' -include (with torch's ninja step wrapped to provide the
    header). Idempotent."""
    import torch.utils.cpp_extension as cpp_extension
    from deepspeed.ops.op_builder.builder import OpBuilder

    if getattr(OpBuilder.jit_load, "trainer3d_flags", False):
        return
    require("zero/ops.py")
    ask_cpu_once()
    jit_load, run_ninja = OpBuilder.jit_load, cpp_extension._run_ninja_build

    def load(self, verbose=True):
        cxx_args = self.cxx_args
        include = ["-include", PCH_HEADER] if self.name in PRECOMPILED else []
        self.cxx_args = lambda: [a for a in cxx_args() if a != DEBUG_FLAG] + [LIGHT_TORCH_HEADER, *include]
        return jit_load(self, verbose)

    def ninja_with_header(build_directory, verbose, error_prefix):
        """torch calls this under its lock of the build directory, after writing build.ninja."""
        if os.path.basename(build_directory) not in PRECOMPILED:
            return run_ninja(build_directory, verbose, error_prefix)
        header = os.path.join(build_directory, PCH_HEADER)
        if not os.path.exists(header):
            write_text_atomic(header, "#include <torch/extension.h>\n")
        _plain_units_without_header(build_directory)
        gch = None if os.path.isfile(_library(build_directory)) else _precompile(build_directory)  # from scratch
        try:
            return run_ninja(build_directory, verbose, error_prefix)
        finally:
            if gch:
                os.remove(gch)

    load.trainer3d_flags = True
    OpBuilder.jit_load, cpp_extension._run_ninja_build = load, ninja_with_header


def ask_cpu_once() -> None:
    """py-cpuinfo answers get_cpu_info from a new Python process each call (~1 s of CPU), and DeepSpeed asks at each
    op load (cpu_arch, simd_width) and each DeepSpeedCPUAdam (one per ZeRO engine that offloads the optimizer): 3-5
    times in every rank of an offloaded run. A process's CPU does not change: asked once. Idempotent."""
    import cpuinfo

    if not hasattr(cpuinfo.get_cpu_info, "cache_info"):
        cpuinfo.get_cpu_info = functools.cache(cpuinfo.get_cpu_info)


def _library(op_dir: str) -> str:
    """The op's shared library in its build directory (torch names it after the directory)."""
    return os.path.join(op_dir, os.path.basename(op_dir) + ".so")


def _ninja_variables(op_dir: str) -> dict[str, list[str]] | None:
    """The top-level variables (`cxx`, `cflags`, ...) of an op's build.ninja (torch's JIT writes it); None without
    one."""
    try:
        with open(os.path.join(op_dir, "build.ninja")) as f:
            return _variables(f.read().splitlines())
    except OSError:
        return None


def _variables(lines: list[str]) -> dict[str, list[str]]:
    """build.ninja's top-level variables, each split as the shell would (a build statement's own, indented, are not)."""
    import shlex

    return {key: shlex.split(value) for key, eq, value in (line.partition(" = ") for line in lines)
            if eq and key.isidentifier()}


def _cflags(op_dir: str) -> list[str] | None:
    """The compiler flags of an op's build.ninja, None without one."""
    ninja = _ninja_variables(op_dir)
    return None if ninja is None else ninja.get("cflags", [])


def _built_with_other_flags(op_dir: str) -> bool:
    """An op built by other flags than op_build_flags' (a checkout's from before them): the next load would rebuild it."""
    cflags = _cflags(op_dir)
    if cflags is None:
        return False
    return (DEBUG_FLAG in cflags or LIGHT_TORCH_HEADER not in cflags
            or (os.path.basename(op_dir) in PRECOMPILED) != ("-include" in cflags))


def _includes_torch(path: str, include_dirs: list[str], seen: set[str]) -> bool:
    """A source that includes a torch header, itself or through the quoted includes it finds (as the compiler would:
    beside it, then in the -I directories)."""
    import re

    with open(path, errors="replace") as f:
        text = f.read()
    if re.search(r"#\s*include\s*<(torch|ATen|c10)/", text):
        return True
    for name in re.findall(r'#\s*include\s*"([^"]+)"', text):
        candidates = (os.path.normpath(os.path.join(d, name)) for d in [os.path.dirname(path), *include_dirs])
        found = next((c for c in candidates if os.path.isfile(c)), None)
        if found and found not in seen:
            seen.add(found)
            if _includes_torch(found, include_dirs, seen):
                return True
    return False


def _plain_units_without_header(op_dir: str) -> None:
    """Give the op's units that include no torch header (async_io's three in aio/common) the flags less `-include`:
    the precompiled header costs each unit ~10 s of CPU (the template instantiations torch's headers defer to the
    end of every unit that includes them), where such a unit alone compiles in ~1 s. torch wrote build.ninja just
    before this (it does on every load), so its per-unit `cflags` lines are added the same way each time."""
    import shlex

    path = os.path.join(op_dir, "build.ninja")
    with open(path) as f:
        lines = [line for line in f.read().splitlines() if not line.startswith(UNIT_CFLAGS)]  # ours, if still there
    flags = _variables(lines).get("cflags", [])
    include_dirs = [a[2:] for a in flags if a.startswith("-I")]
    out, changed = [], False
    for line in lines:
        out.append(line)
        source = line.split()[-1] if line.startswith("build ") and ": compile " in line else None
        if source and os.path.isfile(source) and not _includes_torch(source, include_dirs, set()):
            out.append(UNIT_CFLAGS + shlex.join(_without_header(flags)))
            changed = True
    if changed:
        write_text_atomic(path, "\n".join(out) + "\n")


def _without_header(flags: list[str]) -> list[str]:
    """Compiler flags less `-include PCH_HEADER`."""
    at = flags.index("-include")
    return flags[:at] + flags[at + 2:]


def _precompile(op_dir: str) -> str | None:
    """PCH_HEADER's .gch for the op in `op_dir`, compiled as ninja will compile its sources; None if that failed (the
    sources then parse the header themselves)."""
    import subprocess

    ninja = _ninja_variables(op_dir) or {}
    flags = _without_header(ninja.get("cflags", []) + ninja.get("post_cflags", []))
    gch = os.path.join(op_dir, PCH_HEADER + ".gch")
    cmd = [*ninja.get("cxx", ["c++"]), *flags, "-x", "c++-header", PCH_HEADER, "-o", gch]
    done = subprocess.run(cmd, cwd=op_dir, capture_output=True, text=True)
    return gch if done.returncode == 0 else None


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
        if not os.path.isfile(_library(d)) or os.path.exists(os.path.join(d, "lock")) or _built_with_other_flags(d):
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
    op_build_flags()
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
