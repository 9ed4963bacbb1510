"""Measuring instruments, installed from the benchmark side (the trainer is not modified):

- CommCounter: wraps torch.distributed's collectives and point-to-point calls (in both `torch.distributed` and
  `torch.distributed.distributed_c10d`, so `P2POp(dist.isend, ...)` and DeepSpeed's captured function handles see
  the wrapper) and records, per call, the op, the payload bytes passed to it and the group. DDP's bucket
  all-reduce runs in C++ and never reaches Python, so `count_ddp` registers torch's default all-reduce comm hook
  (which calls `dist.all_reduce`, hence the counter) on the DDP-wrapped stages.
- MallocCounter: bytes malloc'd by the process now and at peak (bench/memhook.c, preloaded into the spawned
  workers): the CPU analogue of torch.cuda.max_memory_allocated, including allocations made in C++ (DDP buckets,
  pipeline receive buffers, DeepSpeed partitions) that a gc walk of Python objects would miss.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# op name -> how to find (payload tensors, group) in its arguments. Payload convention ("what is passed to the
# call"): all_reduce / broadcast / send: the tensor; all_gather: the gathered output (= n × the shard);
# reduce_scatter: the input (= n × the output shard).
_SPECS = {
    "all_reduce": (("tensor", 0), ("group", 2)),
    "broadcast": (("tensor", 0), ("group", 2)),
    "reduce": (("tensor", 0), ("group", 3)),
    "all_gather": (("tensor_list", 0), ("group", 2)),
    "all_gather_into_tensor": (("output_tensor", 0), ("group", 2)),
    "_all_gather_base": (("output_tensor", 0), ("group", 2)),
    "all_gather_single": (("output_tensor", 0), ("group", 2)),  # torch 2.13's names of the two above and below
    "reduce_scatter_single": (("input", 1), ("group", 3)),
    "reduce_scatter": (("input_list", 1), ("group", 3)),
    "reduce_scatter_tensor": (("input", 1), ("group", 3)),
    "_reduce_scatter_base": (("input", 1), ("group", 3)),
    "all_to_all_single": (("input", 1), ("group", 4)),
    "send": (("tensor", 0), ("group", 2)),
    "isend": (("tensor", 0), ("group", 2)),
    "recv": (("tensor", 0), ("group", 2)),
    "irecv": (("tensor", 0), ("group", 2)),
}
RECEIVES = {"recv", "irecv"}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


@dataclass
class Call:
    op: str
    nbytes: int
    group_ranks: tuple[int, ...]
    group: object
    seconds: float = 0.0  # wall time inside the call (gloo's collectives return when done; sends when queued)


class CommCounter:
    def __init__(self):
        self.calls: list[Call] = []
        self.enabled = False
        self._local = threading.local()
        self._originals: dict[str, object] = {}

    # ---- installation ---------------------------------------------------------------------------------------
    def install(self) -> CommCounter:
        for name, ((arg_name, arg_pos), (group_name, group_pos)) in _SPECS.items():
            orig = getattr(c10d, name, None)
            if orig is None or name in self._originals:
                continue
            self._originals[name] = orig
            wrapper = self._wrap(name, orig, arg_name, arg_pos, group_name, group_pos)
            setattr(c10d, name, wrapper)
            if getattr(dist, name, None) is orig:
                setattr(dist, name, wrapper)
        return self

    def uninstall(self) -> None:
        for name, orig in self._originals.items():
            if getattr(dist, name, None) is getattr(c10d, name):
                setattr(dist, name, orig)
            setattr(c10d, name, orig)
        self._originals.clear()

    def _wrap(self, name, orig, arg_name, arg_pos, group_name, group_pos):
        counter = self

        def wrapper(*args, **kwargs):
            depth = getattr(counter._local, "depth", 0)
            if counter.enabled and depth == 0:
                payload = kwargs.get(arg_name, args[arg_pos] if len(args) > arg_pos else None)
                group = kwargs.get(group_name, args[group_pos] if len(args) > group_pos else None)
                if group is None:
                    group = c10d._get_default_group()
                try:
                    ranks = tuple(dist.get_process_group_ranks(group))
                except Exception:  # noqa: BLE001
                    ranks = ()
                call = Call(name, _nbytes(payload), ranks, group)
                counter.calls.append(call)
            else:
                call = None
            counter._local.depth = depth + 1
            start = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                counter._local.depth = depth
                if call is not None:
                    call.seconds = time.perf_counter() - start

        wrapper.__name__ = name
        wrapper.__wrapped__ = orig
        return wrapper

    # ---- DDP -----------------------------------------------------------------------------------------------------
    @staticmethod
    def count_ddp(modules) -> None:
        """Route DDP's bucket all-reduce through Python's dist.all_reduce (torch's default comm hook, same
        arithmetic: divide by the group size, sum) so the counter sees it."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel

        for m in modules:
            if isinstance(m, DistributedDataParallel):
                m.register_comm_hook(m.process_group, default_hooks.allreduce_hook)

    # ---- reading -------------------------------------------------------------------------------------------------
    def reset(self) -> None:
        self.calls = []

    def by_group(self, name_of) -> dict[str, dict[str, list[int]]]:
        """{group name: {op: [payload bytes of each call]}} for this rank's sends (receives left out)."""
        out: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
        for c in self.calls:
            if c.op in RECEIVES:
                continue
            out[name_of(c)][c.op].append(c.nbytes)
        return {k: dict(v) for k, v in out.items()}


def group_namer(topo):
    """Name the group of a call by comparing it with the Topology's groups: the same object first, else the same
    member ranks (DeepSpeed builds its own groups over the same ranks)."""
    named = [
        ("tp", topo.tp_group),
        ("cp", topo.cp_group),
        ("pp", topo.pp_group),
        ("dp", topo.dp_cp_group),  # gradients are reduced over dp × cp (dp itself at cp 1)
        ("embedding", topo.embedding_group),
        ("mp", topo.mp_group),
        ("world", topo.world_group),
    ]
    by_ranks = {}
    for name, g in named:
        if g is not None:
            by_ranks.setdefault(tuple(dist.get_process_group_ranks(g)), name)

    def name_of(call: Call) -> str:
        for name, g in named:
            if g is not None and call.group is g:
                return name
        return by_ranks.get(call.group_ranks, f"other{list(call.group_ranks)}")

    return name_of


# ---- memory ---------------------------------------------------------------------------------------------------
# torch has no CPU counterpart of torch.cuda.max_memory_allocated, and torch.profiler's memory events miss frees
# that happen on gloo's worker threads (and blocks allocated before profiling), so its running sum drifts. We
# count malloc itself instead: bench/memhook.c, preloaded into the worker processes.
_HOOK_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "memhook.c")


def memhook_library() -> str | None:
    """Path of the compiled malloc counter (built once per source version with the system C compiler), or None
    when no compiler is available."""
    import hashlib
    import shutil
    import subprocess
    import tempfile

    src = open(_HOOK_SRC, "rb").read()
    out_dir = os.path.join(tempfile.gettempdir(), f"trainer3d-memhook-{os.getuid()}")
    lib = os.path.join(out_dir, f"memhook-{hashlib.sha1(src).hexdigest()[:12]}.so")
    if os.path.exists(lib):
        return lib
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    os.makedirs(out_dir, exist_ok=True)
    tmp = f"{lib}.{os.getpid()}.tmp"
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", tmp, _HOOK_SRC], check=True, capture_output=True)
    os.replace(tmp, lib)  # atomic: concurrent builders do not see a half-written library
    return lib


class preloaded_memhook:
    """Context manager for the parent process: processes spawned inside it load the malloc counter."""

    def __init__(self):
        self.lib = memhook_library()
        self._old = None

    def __enter__(self):
        self._old = os.environ.get("LD_PRELOAD")
        if self.lib:
            os.environ["LD_PRELOAD"] = self.lib + (" " + self._old if self._old else "")
        return self

    def __exit__(self, *exc):
        if self._old is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = self._old


def run_under_memhook(cmd: list[str], cwd: str) -> dict:
    """`cmd` in a process of its own under the malloc counter: the JSON object its last printed line holds, plus
    `hwm`, the kernel's high-water mark of its resident set, read from outside (/proc/<pid>/status) while it runs."""
    import json
    import subprocess

    with preloaded_memhook():
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=cwd)
    hwm = 0
    while proc.poll() is None:
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                hwm = max([hwm] + [int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM")])
        except OSError:
            pass
        time.sleep(0.02)
    return {"hwm": hwm, **json.loads(proc.stdout.read().strip().splitlines()[-1])}


class MallocCounter:
    """In a process started under preloaded_memhook: bytes currently malloc'd and the peak since reset."""

    def __init__(self):
        import ctypes

        self._lib = None
        for path in os.environ.get("LD_PRELOAD", "").split():
            if "memhook" in path:
                self._lib = ctypes.CDLL(path)
                for fn in ("memhook_current", "memhook_peak"):
                    getattr(self._lib, fn).restype = ctypes.c_longlong
        if self._lib is None:
            raise RuntimeError("the malloc counter is not loaded: start this process under preloaded_memhook()")

    def current(self) -> int:
        return int(self._lib.memhook_current())

    def peak(self) -> int:
        return int(self._lib.memhook_peak())

    def reset_peak(self) -> None:
        self._lib.memhook_reset_peak()


@contextlib.contextmanager
def kept_per_block(stages, counter: MallocCounter):
    """Puts each stage in training mode and yields a list that collects, for every block forward while inside, the
    bytes still allocated when the block returns minus those before it started (what it keeps for its backward)."""
    kept: list[int] = []
    before: dict[int, int] = {}
    hooks = []
    for stage in stages:
        stage.train()
        for block in stage.blocks.values():
            hooks.append(block.register_forward_pre_hook(lambda m, args: before.__setitem__(id(m), counter.current())))
            hooks.append(block.register_forward_hook(lambda m, args, out: kept.append(counter.current() - before[id(m)])))
    try:
        yield kept
    finally:
        for hook in hooks:
            hook.remove()


def model_state_bytes(trainer) -> dict[str, int]:
    """Bytes of this rank's parameters, gradients and optimizer state, by walking the trainer's objects (each
    storage counted once: the tied wte/lm_head Parameter is one tensor)."""
    seen: set[int] = set()

    def nb(t) -> int:
        if t is None or not isinstance(t, torch.Tensor):
            return 0
        key = t.untyped_storage().data_ptr()
        if key in seen or t.device.type == "meta":
            return 0
        seen.add(key)
        return t.untyped_storage().nbytes()

    params = trainer.engine.params  # DDP engine: this rank's parameters, each once
    out = {"params": sum(nb(p) for p in params), "grads": sum(nb(p.grad) for p in params)}
    out["optimizer"] = sum(nb(v) for st in trainer.engine.optimizer.state.values() for v in st.values())
    out["n_params"] = sum(p.numel() for p in params)
    return out
