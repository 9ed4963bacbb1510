"""Calibration: a few seconds of micro-benchmarks on the machine a run will use, in place of the planner's assumed
constants (`--mfu`, `--overlap`, the bandwidths, no latency).

Every rank measures at once, as training runs: the matmuls of a block at the model's shapes in the run's precision;
for each link (the ranks of a node, one rank per node) and each kind of call the trainer makes (OPS), the latency per
ring step and the bandwidth, fitted as `time = steps × latency + wire bytes / bandwidth` from a small and a large
payload (plan/comm.py's ring steps and wire bytes); the share of an all-reduce a matmul beside it hides; how many
ranks share a processor (one rank's matmuls alone against all at once: 1 with a GPU each; more on a CPU host with
more ranks than cores, where a rank idle in a pipeline bubble leaves its share to the others); and the optimizer
step's rate. Cached per kind of machine (device, ranks per node, dtype) and read back by the planner (`apply`,
`constants`), so `--layout auto` plans with what this machine measured.

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

from trainer3d.distributed.collectives import all_gather_into
from trainer3d.fsio import write_text_atomic
from trainer3d.plan.cluster import Cluster
from trainer3d.plan.comm import ring_factor, ring_steps

SMALL, LARGE = 4 << 10, 16 << 20  # payload bytes of the latency and the bandwidth measurement
OPS = ("all_reduce", "all_gather", "send")  # the calls measured on each link (plan/cluster.Cluster.link reads them)
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
    intra: dict[str, Link] | None  # per op of OPS, over the ranks of one node
    inter: dict[str, Link] | None  # per op, over ranks of different nodes
    overlap: float  # the fraction of an all-reduce beside a matmul that the matmul hides
    ranks_per_processor: float  # one rank's matmul speed alone over its speed with every rank busy (1: its own device)
    adam_params_per_s: float  # the optimizer step (optim.adam), parameters per second per rank, every rank busy
    seconds: float  # what the measurement took
    date: str

    def describe(self) -> str:
        def link(where: str, ops: dict[str, Link] | None) -> str:
            return f"{where} " + (" / ".join(f"{op.replace('_', '-')} {v.gbps:.2f} GB/s {v.latency_s * 1e6:.0f} µs"
                                              for op, v in ops.items()) if ops else "n/a")

        return (f"{self.matmul_tflops:.3g} TFLOP/s per rank ({self.dtype} matmuls); {link('in a node:', self.intra)}; "
                f"{link('across nodes:', self.inter)} (latency per ring step); overlap {self.overlap:.2f}; "
                f"{self.ranks_per_processor:.1f} ranks per processor; AdamW {self.adam_params_per_s:.3g} params/s "
                f"({self.device}, {self.nodes} node(s) × {self.ranks_per_node} ranks, measured {self.date} in "
                f"{self.seconds:.1f} s)")


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
        for where in ("intra", "inter"):
            d[where] = {op: Link(**d[where][op]) for op in OPS} if d.get(where) else None
        return Calibration(**d)
    except (OSError, ValueError, TypeError, KeyError):
        return None


def save(calib: Calibration, device: torch.device, root=None) -> Path:
    path = cache_path(calib.device, calib.ranks_per_node, calib.dtype, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(asdict(calib), indent=1) + "\n")
    return path


def constants(calib: Calibration) -> dict[str, object]:
    """The Cluster fields a calibration measures: the matmul throughput as the kernels' speed (mfu 1 of it), each
    measured link's all-reduce bandwidth and latency as the link's, every op's own (`op_links`), the overlap."""
    out: dict[str, object] = dict(peak_tflops=calib.matmul_tflops, mfu=1.0, overlap=calib.overlap,
                                  ranks_per_processor=calib.ranks_per_processor,
                                  adam_params_per_s=calib.adam_params_per_s)
    op_links = []
    for where, ops in (("intra", calib.intra), ("inter", calib.inter)):
        if ops is not None:
            out.update({f"{where}_node_gbps": ops["all_reduce"].gbps,
                        f"{where}_node_latency_s": ops["all_reduce"].latency_s})
            op_links += [(where, op, v.gbps, v.latency_s) for op, v in ops.items()]
    out["op_links"] = tuple(op_links)
    return out


def apply(C: Cluster, calib: Calibration) -> Cluster:
    return replace(C, **constants(calib))


# ---- the measurements: every rank calls them together ------------------------------------------------------------
def _slowest(values: list[float], group=None) -> list[float]:
    """Each value's maximum over the ranks (a step waits for the slowest rank)."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def _timed(fn, rounds: int, group=None, min_seconds: float = 0.02) -> float:
    """The median seconds of one `fn` over `rounds` rounds, the ranks starting each round together; a round repeats
    `fn` until it lasts `min_seconds` (the same count on every rank: `fn` may be a collective), so that a small
    kernel is not timed at the clock's and the scheduler's grain."""
    dist.barrier(group=group)
    t0 = time.perf_counter()
    fn()
    # the count from the slowest rank's time (a rank with nothing to do must not set it)
    [slowest] = _slowest([time.perf_counter() - t0], group)
    repeats = max(1, math.ceil(min_seconds / max(slowest, 1e-9)))
    times = []
    for _ in range(rounds):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        times.append((time.perf_counter() - t0) / repeats)
    return statistics.median(times)


def _operands(shapes, dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random [m, k] and [k, n] matrices for each (m, k, n) of `shapes`."""
    return [(torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype))
            for m, k, n in shapes]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _call(op: str, nbytes: int, group, device: torch.device):
    """One call of `op` with a payload of `nbytes` over `group` (plan/comm.py's payloads: an all-gather's gathered
    output; send: each rank sends it to the next rank of the group and receives as much from the previous, as a
    pipeline's neighbours do), to call again and again; an all-reduce's async_op=True returns what to wait on."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    x = torch.ones(max(n, nbytes // 4), device=device)
    if op == "all_reduce":
        return lambda async_op=False: dist.all_reduce(x, group=group, async_op=async_op)
    if op == "all_gather":
        part = x[: x.numel() // n].clone()
        return lambda async_op=False: all_gather_into(x[: part.numel() * n], part, group, async_op)
    peer = lambda i: dist.get_global_rank(group, i % n) if group is not None else i % n  # noqa: E731
    got = torch.empty_like(x)

    def exchange(async_op: bool = False):
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer(me + 1), group),
                                        dist.P2POp(dist.irecv, got, peer(me - 1), group)])
        for w in works:
            w.wait()

    return exchange


def matmul_tflops(shapes: list[tuple[int, int, int]], dtype: torch.dtype, device: torch.device, rounds: int,
                  alone: bool = False) -> float:
    """TFLOP/s of the forward and backward matmuls of one block, [m, k] @ [k, n] for each (m, k, n), every rank
    at once (the slowest rank's: a step waits for it), or rank 0's while the others wait (`alone`)."""
    mats = _operands(shapes, dtype, device) if not alone or dist.get_rank() == 0 else []
    flops = sum(3 * 2 * m * k * n for m, k, n in shapes)  # forward + the two backward matmuls

    def run() -> None:
        for a, b in mats:
            c = a @ b
            c @ b.T, a.T @ c  # noqa: B018 - the input's and the weight's gradients
        _synchronize(device)

    run()
    [seconds] = _slowest([_timed(run, rounds)])
    return flops / seconds / 1e12


def adam_params_per_s(device: torch.device, rounds: int, n: int = 1 << 21) -> float:
    """Parameters per second of the trainer's AdamW step (trainer3d.optim.adam: fused where torch has it) over `n`
    fp32 parameters, every rank at once; the slowest rank's."""
    from trainer3d.optim import adam

    p = torch.nn.Parameter(torch.randn(n, device=device))
    p.grad = torch.randn(n, device=device)
    opt = adam([p], lr=1e-4, betas=(0.9, 0.95), eps=1e-8)

    def step() -> None:
        opt.step()
        _synchronize(device)

    step()  # the moments allocated
    [seconds] = _slowest([_timed(step, rounds)])
    return n / seconds


def links(group, n: int, device: torch.device, rounds: int) -> dict[str, Link]:
    """Per op of OPS over a group: the latency per ring step and the bandwidth, fitted from SMALL and LARGE bytes."""
    out = {}
    for op in OPS:
        small = _timed(_call(op, SMALL, group, device), rounds, group)
        large = _timed(_call(op, LARGE, group, device), max(2, rounds // 2), group)
        steps, factor = ring_steps(op, n), ring_factor(op, n)
        latency = small / steps
        out[op] = Link(latency_s=latency, gbps=LARGE * factor / max(large - steps * latency, 1e-9) / 1e9)
    return out


def overlap(device: torch.device, shapes, dtype: torch.dtype, rounds: int) -> float:
    """The share of a LARGE all-reduce over the world that a matmul running beside it hides: (alone + alone −
    together) / the shorter of the two, in [0, 1]."""
    reduce, mats = _call("all_reduce", LARGE, None, device), _operands(shapes, dtype, device)

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
    # a processor shared by several ranks (more ranks than cores) runs one rank faster while the others wait
    shared = min(max(matmul_tflops(shapes, dtype, device, rounds, alone=True) / tflops, 1.0), ranks_per_node)
    adam_rate = adam_params_per_s(device, rounds)
    intra_group, inter_group, nodes = node_groups(ranks_per_node)
    intra = links(intra_group, ranks_per_node, device, rounds) if ranks_per_node > 1 else None
    inter = links(inter_group, nodes, device, rounds) if inter_group is not None else None
    ov = overlap(device, shapes, dtype, rounds) if dist.get_world_size() > 1 else 0.0
    agreed = [_agreed(v) for v in (intra, inter)]
    return Calibration(host=socket.gethostname(), device=device_name(device), ranks_per_node=ranks_per_node,
                       nodes=nodes, dtype={v: k for k, v in DTYPES.items()}[dtype], matmul_tflops=tflops,
                       intra=agreed[0], inter=agreed[1], overlap=ov, ranks_per_processor=shared,
                       adam_params_per_s=adam_rate, seconds=time.perf_counter() - t0,
                       date=time.strftime("%Y-%m-%d %H:%M %Z"))


def _agreed(ops: dict[str, Link] | None) -> dict[str, Link] | None:
    """Per op, the slowest rank's link (the largest latency, the smallest bandwidth): a step waits for it. Every rank
    calls it alike (a node's group measured on each node)."""
    if ops is None:
        return None
    t = _slowest([x for v in ops.values() for x in (v.latency_s, -v.gbps)])
    return {op: Link(latency_s=t[2 * i], gbps=-t[2 * i + 1]) for i, op in enumerate(ops)}


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
