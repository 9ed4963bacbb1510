"""Calibration: a few seconds of micro-benchmarks on the machine a run will use, in place of the planner's assumed
constants (`--mfu`, `--overlap`, the bandwidths, no latency).

Every rank measures at once, as training runs (on a host with fewer cores than ranks, each rank's share of them is
what it gets): the matmul throughput at the model's shapes in the run's precision; then, over the ranks of a node and
over one rank per node (where the launcher says there are several), each link's latency per ring step and bandwidth,
fitted as `time = steps × latency + wire bytes / bandwidth` from an all-reduce of a small and of a large payload
(steps: a ring's, 2(n−1) for an all-reduce; the cost model prices every other collective by its own ring steps and
wire bytes over the same link); and how much of an all-reduce running beside a matmul hides behind it (the overlap). The result is cached per kind of machine (device, ranks per node, dtype) under the data
cache's folder and read back by the planner (`apply`, `constants`), so `--layout auto` plans with what this machine
measured.

    torchrun --nproc_per_node 8 -m trainer3d.plan --calibrate --model gpt2 --seq-len 1024
"""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from trainer3d.fsio import write_text_atomic
from trainer3d.plan.cluster import Cluster
from trainer3d.plan.comm import ring_factor, ring_steps

SMALL, LARGE = 4 << 10, 16 << 20  # payload bytes of the latency and the bandwidth measurement
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Link:
    latency_s: float  # per ring step
    gbps: float  # GB/s of wire bytes per rank


@dataclass(frozen=True)
class Calibration:
    host: str
    device: str
    ranks_per_node: int
    nodes: int
    dtype: str
    matmul_tflops: float  # per rank, every rank busy
    intra: Link | None  # ranks of one node
    inter: Link | None  # ranks of different nodes
    overlap: float  # the fraction of an all-reduce beside a matmul that the matmul hides
    seconds: float  # what the measurement took
    date: str

    def describe(self) -> str:
        link = lambda k, v: f"{k} {v.gbps:.2f} GB/s, {v.latency_s * 1e6:.0f} µs/step" if v else f"{k} n/a"  # noqa: E731
        return (f"{self.matmul_tflops:.3g} TFLOP/s per rank ({self.dtype} matmuls), {link('in a node', self.intra)}, "
                f"{link('across nodes', self.inter)}, overlap {self.overlap:.2f} ({self.device}, {self.nodes} node(s) "
                f"× {self.ranks_per_node} ranks, measured {self.date} in {self.seconds:.1f} s)")


def cache_path(device: str, ranks_per_node: int, dtype: str, root: str | os.PathLike | None = None) -> Path:
    """Per kind of machine: its device, how many ranks share it, the precision (not the host's name: the nodes of a
    homogeneous cluster share one calibration, through a shared $TRAINER3D_CACHE or a copy on each node)."""
    base = Path(root or os.environ.get("TRAINER3D_CALIBRATION") or Path(
        os.environ.get("TRAINER3D_CACHE") or Path.home() / ".cache" / "trainer3d") / "calibration")
    return base / f"{device.replace(' ', '_')}-{ranks_per_node}ranks-{dtype}.json"


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu{os.cpu_count()}"


def load(device: torch.device, ranks_per_node: int, dtype: str, root=None) -> Calibration | None:
    """The cached calibration of this machine, or None (nothing measured yet, or an unreadable file)."""
    path = cache_path(device_name(device), ranks_per_node, dtype, root)
    try:
        d = json.loads(path.read_text())
        d["intra"] = Link(**d["intra"]) if d.get("intra") else None
        d["inter"] = Link(**d["inter"]) if d.get("inter") else None
        return Calibration(**d)
    except (OSError, ValueError, TypeError, KeyError):
        return None


def save(calib: Calibration, device: torch.device, root=None) -> Path:
    path = cache_path(calib.device, calib.ranks_per_node, calib.dtype, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(asdict(calib), indent=1) + "\n")
    return path


def constants(calib: Calibration) -> dict[str, float]:
    """The Cluster fields a calibration measures: the matmul throughput as the kernels' speed (mfu 1 of it), the
    links' bandwidths and latencies (those measured), the overlap."""
    out = dict(peak_tflops=calib.matmul_tflops, mfu=1.0, overlap=calib.overlap)
    if calib.intra is not None:
        out.update(intra_node_gbps=calib.intra.gbps, intra_node_latency_s=calib.intra.latency_s)
    if calib.inter is not None:
        out.update(inter_node_gbps=calib.inter.gbps, inter_node_latency_s=calib.inter.latency_s)
    return out


def apply(C: Cluster, calib: Calibration) -> Cluster:
    return replace(C, **constants(calib))


# ---- the measurements: every rank calls them together ------------------------------------------------------------
def _timed(fn, rounds: int, group=None, min_seconds: float = 0.02) -> float:
    """The median seconds of one `fn` over `rounds` rounds, the ranks starting each round together; a round repeats
    `fn` until it lasts `min_seconds` (the same count on every rank: `fn` may be a collective), so that a small
    kernel is not timed at the clock's and the scheduler's grain."""
    dist.barrier(group=group)
    t0 = time.perf_counter()
    fn()
    repeats = torch.tensor(max(1, math.ceil(min_seconds / max(time.perf_counter() - t0, 1e-9))))
    dist.all_reduce(repeats, op=dist.ReduceOp.MAX, group=group)
    times = []
    for _ in range(rounds):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for _ in range(int(repeats)):
            fn()
        times.append((time.perf_counter() - t0) / int(repeats))
    return statistics.median(times)


def _operands(shapes, dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random [m, k] and [k, n] matrices for each (m, k, n) of `shapes`."""
    return [(torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype))
            for m, k, n in shapes]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _all_reduce(nbytes: int, group, device: torch.device):
    """An all-reduce of `nbytes` over `group`, to call again and again (async_op=True: its Work)."""
    x = torch.ones(max(1, nbytes // 4), device=device)
    return lambda async_op=False: dist.all_reduce(x, group=group, async_op=async_op)


def matmul_tflops(shapes: list[tuple[int, int, int]], dtype: torch.dtype, device: torch.device, rounds: int) -> float:
    """TFLOP/s of the forward and backward matmuls of one block, [m, k] @ [k, n] for each (m, k, n), every rank
    at once; the slowest rank's (a step waits for it)."""
    mats = _operands(shapes, dtype, device)
    flops = sum(3 * 2 * m * k * n for m, k, n in shapes)  # forward + the two backward matmuls

    def run() -> None:
        for a, b in mats:
            c = a @ b
            c @ b.T, a.T @ c  # noqa: B018 - the input's and the weight's gradients
        _synchronize(device)

    run()
    seconds = torch.tensor(_timed(run, rounds), dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return flops / float(seconds) / 1e12


def link(group, n: int, device: torch.device, rounds: int) -> Link:
    """Latency per ring step and bandwidth of a group, fitted from all-reduces of SMALL and LARGE bytes."""
    small = _timed(_all_reduce(SMALL, group, device), rounds, group)
    large = _timed(_all_reduce(LARGE, group, device), max(2, rounds // 2), group)
    steps, factor = ring_steps("all_reduce", n), ring_factor("all_reduce", n)
    latency = small / steps
    gbps = LARGE * factor / max(large - steps * latency, 1e-9) / 1e9
    return Link(latency_s=latency, gbps=gbps)


def overlap(device: torch.device, shapes, dtype: torch.dtype, rounds: int) -> float:
    """The share of a LARGE all-reduce over the world that a matmul running beside it hides: (alone + alone −
    together) / the shorter of the two, in [0, 1]."""
    reduce, mats = _all_reduce(LARGE, None, device), _operands(shapes, dtype, device)

    def compute() -> None:
        for a, b in mats:
            a @ b  # noqa: B018
        _synchronize(device)

    def both() -> None:
        work = reduce(async_op=True)
        compute()
        work.wait()

    t_c, t_a, t_b = (_timed(f, rounds) for f in (compute, reduce, both))
    hidden = torch.tensor((t_c + t_a - t_b) / max(min(t_c, t_a), 1e-9), dtype=torch.float64)
    dist.all_reduce(hidden, op=dist.ReduceOp.MIN)
    return float(hidden.clamp(0.0, 1.0))


def block_shapes(cfg, tokens: int) -> list[tuple[int, int, int]]:
    """A transformer block's matmuls for `tokens` rows: q|k|v, the output projection and the MLP's two (SwiGLU's
    gate|up as one), [m, k, n] each."""
    h = cfg.n_embd
    ffn = getattr(cfg, "ffn_hidden", None) or 4 * h
    up = 2 * ffn if getattr(cfg, "ffn_hidden", None) else ffn
    return [(tokens, h, 3 * h), (tokens, h, h), (tokens, h, up), (tokens, ffn, h)]


def node_groups(ranks_per_node: int):
    """(this rank's node group, this rank's cross-node group of one rank per node, or None on one node); every rank
    creates every group (new_group is collective)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    nodes = world // ranks_per_node
    mine_intra = mine_inter = None
    for node in range(nodes):
        g = dist.new_group(list(range(node * ranks_per_node, (node + 1) * ranks_per_node)))
        if rank // ranks_per_node == node:
            mine_intra = g
    if nodes > 1:
        for local in range(ranks_per_node):
            g = dist.new_group([node * ranks_per_node + local for node in range(nodes)])
            if rank % ranks_per_node == local:
                mine_inter = g
    return mine_intra, mine_inter, nodes


def calibrate(cfg, tokens: int, dtype: torch.dtype, device: torch.device, ranks_per_node: int,
              rounds: int = 5) -> Calibration:
    """Every rank: the measurements above, agreed (the slowest rank's throughput, the worst link)."""
    t0 = time.perf_counter()
    shapes = block_shapes(cfg, tokens)
    tflops = matmul_tflops(shapes, dtype, device, rounds)
    intra_group, inter_group, nodes = node_groups(ranks_per_node)
    intra = link(intra_group, ranks_per_node, device, rounds) if ranks_per_node > 1 else None
    inter = link(inter_group, nodes, device, rounds) if inter_group is not None else None
    ov = overlap(device, shapes, dtype, rounds) if dist.get_world_size() > 1 else 0.0
    links = [_agreed(v) for v in (intra, inter)]
    return Calibration(host=socket.gethostname(), device=device_name(device), ranks_per_node=ranks_per_node,
                       nodes=nodes, dtype={v: k for k, v in DTYPES.items()}[dtype], matmul_tflops=tflops, intra=links[0],
                       inter=links[1], overlap=ov, seconds=time.perf_counter() - t0,
                       date=time.strftime("%Y-%m-%d %H:%M %Z"))


def _agreed(v: Link | None) -> Link | None:
    """The slowest rank's link (the largest latency, the smallest bandwidth): a step waits for it."""
    if v is None:
        return None
    t = torch.tensor([v.latency_s, -v.gbps], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return Link(latency_s=float(t[0]), gbps=float(-t[1]))


def run(cfg, tokens: int, precision: str | None = None, root=None) -> int:
    """`python -m trainer3d.plan --calibrate` under a launcher (torchrun: every rank of the node; plain python: one
    rank, no links): measure, then rank 0 caches and prints the result."""
    from trainer3d.distributed.topology import LaunchEnv, WorldGroup, default_device

    env = LaunchEnv.from_environ()
    device = default_device(env.local_rank)
    dtype = DTYPES[precision or ("bf16" if device.type == "cuda" else "fp32")]
    ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size))
    group = WorldGroup(env, device, 300.0)
    try:
        calib = calibrate(cfg, tokens, dtype, device, ranks_per_node)
        if env.rank == 0:
            path = save(calib, device, root)
            print(f"calibration: {calib.describe()}\nwritten to {path}; `--layout auto` and `python -m trainer3d.plan "
                  "--calibrated` plan with it", flush=True)
    finally:
        group.close()
    return 0
