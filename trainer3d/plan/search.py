"""The layout planner: `python -m trainer3d.plan`.

Given a model, a cluster and a global batch, enumerate every layout trainer3d can run (dp, tp, pp, schedule,
virtual stages, micro-batches, ZeRO stage, offload, activation checkpointing), estimate memory per GPU and step
time with the cost model in comm_model.py (the one bench/comm_volume.py and bench/memory.py check against
measurements), refuse what does not fit or cannot run, and print the best few with the reason each wins.
Optionally write the DeepSpeed JSON and print the launch command for a chosen plan.

    python -m trainer3d.plan --model gpt2-xl --nodes 2 --gpus-per-node 8 --gpu-memory-gib 80 \\
        --peak-tflops 989 --global-batch-tokens 524288 --seq-len 1024
    python -m trainer3d.plan --preset-cluster a100-80g --nodes 128 --model gpt3-175b --seq-len 2048 \\
        --global-batch 1536 --launcher sbatch --write-ds-config plan.json

Step time = compute (model FLOPs / GPUs / (peak × --mfu), × 4/3 with recomputation, × the slowest stage's
share) + pipeline bubble (schedule formulas; see bench/pipeline_bubble.py) + exposed communication (payloads
from comm_model.analytic_comm, ring factors, tp over the intra-node bandwidth, dp and pp over the inter-node one
when their groups span nodes; DDP's and ZeRO's gradient reduction overlaps the backward it can overlap) + CPU
offload (PCIe transfers and CPU Adam). It is a model for ranking layouts, not a promise of seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field, replace
from functools import lru_cache

from trainer3d.plan.cost_model import Dims, Layout, analytic_comm, estimate_memory, gib, rank_params
from trainer3d.model import MODEL_PRESETS

# ---- models and clusters -------------------------------------------------------------------------------------
# Beyond trainer3d's GPT-2 presets: published GPT-3-family shapes (Brown et al. 2020; Narayanan et al. 2021).
PLAN_MODELS = {
    "gpt3-1.3b": Dims(n_layer=24, n_embd=2048, n_head=16, vocab=50257, n_positions=2048),
    "gpt3-6.7b": Dims(n_layer=32, n_embd=4096, n_head=32, vocab=50257, n_positions=2048),
    "gpt3-13b": Dims(n_layer=40, n_embd=5120, n_head=40, vocab=50257, n_positions=2048),
    "gpt3-175b": Dims(n_layer=96, n_embd=12288, n_head=96, vocab=50257, n_positions=2048),
    "megatron-1t": Dims(n_layer=128, n_embd=25600, n_head=160, vocab=50257, n_positions=2048),
}

# Per GPU: memory (GiB), dense bf16 peak (TFLOP/s), ring bandwidth inside a node and across nodes (GB/s per GPU).
CLUSTERS = {
    "a100-80g": dict(gpus_per_node=8, gpu_memory_gib=80, peak_tflops=312, intra_node_gbps=230, inter_node_gbps=25),
    "a100-40g": dict(gpus_per_node=8, gpu_memory_gib=40, peak_tflops=312, intra_node_gbps=230, inter_node_gbps=25),
    "h100": dict(gpus_per_node=8, gpu_memory_gib=80, peak_tflops=989, intra_node_gbps=360, inter_node_gbps=50),
}


def zero_buckets(hidden: int) -> dict:
    """DeepSpeed bucket sizes from the hidden size (the rule of HF's and zero.py's "auto" values, plus a bound on
    ZeRO-3's live parameters); the memory model charges the reduce bucket and ZeRO-3's working set accordingly."""
    live = 2 * (12 * hidden * hidden + 13 * hidden)  # two blocks' parameters
    return {
        "reduce_bucket_size": hidden * hidden,
        "allgather_bucket_size": hidden * hidden,
        "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
        "stage3_param_persistence_threshold": 10 * hidden,
        # DeepSpeed's defaults (1e9) keep every gathered parameter of a small model alive through the step;
        # bounded to two blocks, ZeRO-3's working set is what the memory model charges
        "stage3_max_live_parameters": live,
        "stage3_max_reuse_distance": live,
    }


def deepspeed_config(zero_stage: int, offload_optimizer: bool, offload_params: bool, micro_batch_size: int,
                     micro_batches: int, dp: int, precision: str = "bf16-mixed", hidden: int = 1024,
                     grad_clip: float = 1.0) -> dict:
    """The DeepSpeed JSON for a plan, in the form trainer3d/zero.py reads (--deepspeed_config): it owns the batch
    (micro × accumulation × dp), ZeRO stage, offload and precision; the optimizer section is optional (AdamW with
    the trainer's flags) and clipping is the trainer's global one."""
    z: dict = {"stage": zero_stage, "overlap_comm": False, "contiguous_gradients": True, **zero_buckets(hidden)}
    if offload_optimizer:
        z["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload_params:
        z["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_batch_size": micro_batch_size * micro_batches * dp,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": micro_batches,
        "gradient_clipping": grad_clip,
        "bf16": {"enabled": precision != "fp32"},
        "zero_optimization": z,
    }


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu_memory_gib: float
    peak_tflops: float
    intra_node_gbps: float  # GB/s per GPU
    inter_node_gbps: float
    pcie_gbps: float = 25.0  # host <-> GPU, per GPU
    cpu_adam_params_per_s: float = 2e8  # DeepSpeedCPUAdam throughput per GPU's share of the host
    mfu: float = 0.5  # fraction of peak the kernels reach (compute only; bubble and comm come on top)
    overlap: float = 0.5  # fraction of a compute window that communication running beside it can hide behind
    reserve_gib: float = 2.0  # CUDA context, NCCL buffers, allocator fragmentation
    host_memory_gib: float = 1024.0  # per node, for offloaded state

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def usable_bytes(self) -> float:
        return (self.gpu_memory_gib - self.reserve_gib) * 2**30


# ---- a candidate ----------------------------------------------------------------------------------------------
@dataclass
class Plan:
    layout: Layout
    memory: float  # peak bytes per GPU (the worst pipeline rank)
    host: float  # offloaded bytes per GPU
    times: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def step_time(self) -> float:
        return sum(self.times.values())

    def key(self) -> tuple:
        L = self.layout
        return (L.dp, L.tp, L.pp, L.schedule, L.virtual_stages, L.zero_stage, L.offload_optimizer, L.recompute)

    def describe(self) -> str:
        L = self.layout
        s = f"dp{L.dp} tp{L.tp} pp{L.pp}"
        if L.pp > 1:
            s += f" {L.schedule}" + (f" v{L.virtual_stages}" if L.virtual_stages > 1 else "")
        return s


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@lru_cache(maxsize=None)
def _stage_costs(dims: Dims, n_stages: int) -> tuple[float, float]:
    """(slowest stage's forward cost, mean stage cost) with trainer3d's balancing: the pace of a pipeline."""
    from trainer3d.plan.cost_model import _balance

    block = 24 * dims.n_embd**2 + 4 * dims.n_positions * dims.n_embd
    head = 2 * dims.n_embd * dims.vocab
    ranges = _balance(dims, n_stages)
    costs = [len(r) * block + (head if i == n_stages - 1 else 0) for i, r in enumerate(ranges)]
    return max(costs), sum(costs) / len(costs)


def _nodes_spanned(stride: int, size: int, gpn: int) -> bool:
    """Does a group of `size` ranks spaced `stride` apart span more than one node (ranks fill nodes in order)?"""
    return size > 1 and stride * size > gpn if stride < gpn else size > 1


BUBBLE_COEF = {  # idle time per (p-1) micro-batch slots, relative to 1F1B's
    "gpipe": 1.0,
    "1f1b": 1.0,
    "interleaved-1f1b": None,  # 1/v
    "looped-bfs": None,  # 1/v
    # zero-bubble schedules with F = I = W: simulating torch's own ZBV / interleaved-ZB / DualPipeV action lists
    # (bench/pipeline_bubble.py, p=4, m=8) leaves 0.5 of a micro-batch's time per (p-1): 1/6 of 1F1B's bubble
    "zbv": 1 / 6,
    "interleaved-zb": 1 / 6,
    "dualpipev": 1 / 6,
}


def step_times(L: Layout, C: Cluster) -> dict[str, float]:
    """Seconds per optimizer step, by component."""
    from trainer3d.train.metrics import flops_per_token
    from trainer3d.parallel.pipeline import SCHEDULES

    d, N = L.dims, L.world
    cfg = d.gpt_config()
    tokens = L.global_batch * L.seq_len
    model_flops = flops_per_token(cfg, L.seq_len) * tokens
    hw_flops = model_flops * (4 / 3 if L.recompute else 1.0)
    peak = C.peak_tflops * 1e12 * C.mfu
    n_stages = L.pp * (2 if SCHEDULES[L.schedule].v_shape else L.virtual_stages if SCHEDULES[L.schedule].multi_stage else 1)
    slow, mean = _stage_costs(d, n_stages) if L.pp > 1 else (1.0, 1.0)
    compute = hw_flops / N / peak * (slow / mean)
    t_mb = compute / L.micro_batches  # one micro-batch through this rank's stages, forward + backward
    out = {"compute": compute}
    if L.pp > 1:
        coef = BUBBLE_COEF[L.schedule]
        coef = 1.0 / L.virtual_stages if coef is None else coef
        out["bubble"] = (L.pp - 1) * t_mb * coef
    # communication, for the busiest pipeline rank (first or last: embedding / head)
    gpn = C.gpus_per_node
    bw = {
        "tp": C.intra_node_gbps if L.tp <= gpn else C.inter_node_gbps,
        "dp": C.inter_node_gbps if _nodes_spanned(L.tp, L.dp, gpn) else C.intra_node_gbps,
        "pp": C.inter_node_gbps if _nodes_spanned(L.tp * L.dp, L.pp, gpn) else C.intra_node_gbps,
    }
    bw["embedding"] = bw["pp"]
    worst: dict[str, float] = {}
    for r in sorted({0, L.pp - 1}):
        per_group: dict[str, float] = {}
        for t in analytic_comm(L, r):
            if t.group in ("world", "mp"):
                continue  # scalars
            per_group[t.group] = per_group.get(t.group, 0.0) + t.wire / (bw[t.group] * 1e9)
        for g, v in per_group.items():
            worst[g] = max(worst.get(g, 0.0), v)
    out["tp comm"] = worst.get("tp", 0.0)  # on the critical path (Megatron-style TP)
    out["pp comm"] = worst.get("pp", 0.0)  # torch's schedules wait for each receive
    out["embedding"] = worst.get("embedding", 0.0)
    t_dp = worst.get("dp", 0.0)
    ov = C.overlap
    t_bwd_mb = t_mb * 2 / 3
    split = SCHEDULES[L.schedule].split_backward
    if L.zero_stage == 0:
        # DDP overlaps its all-reduce with the last micro-batch's backward; the zero-bubble schedules reduce
        # after the schedule (data_parallel.all_reduce_grads), with nothing to hide behind
        out["dp comm"] = t_dp if split else max(0.0, t_dp - ov * t_bwd_mb)
    elif L.zero_stage in (1, 2):
        rs, ag = t_dp / 2, t_dp / 2  # reduce-scatter and all-gather carry the same bytes
        if L.zero_stage == 2:  # a reduce-scatter every micro-batch (analytic_comm counts them all)
            out["dp comm"] = L.micro_batches * max(0.0, rs / L.micro_batches - ov * t_bwd_mb) + ag
        else:  # reduce at the last micro-batch, all-gather after the step
            out["dp comm"] = max(0.0, rs - ov * t_bwd_mb) + ag
    else:
        # ZeRO-3, per micro-batch: the forward all-gather hides behind the forward (prefetch), the backward
        # all-gather and the reduce-scatter behind the backward
        per_mb = t_dp / L.micro_batches
        ag, rs = per_mb / 3, per_mb / 3
        out["dp comm"] = L.micro_batches * (max(0.0, ag - ov * t_mb / 3) + max(0.0, ag + rs - ov * t_bwd_mb))
    n_local = max(rank_params(d, L.tp, L.stages(r)) for r in sorted({0, L.pp - 1}))
    if L.offload_optimizer:
        shard = n_local / L.dp
        out["offload"] = shard / C.cpu_adam_params_per_s + shard * (4 + 2) / (C.pcie_gbps * 1e9)
    if L.offload_params:
        out["offload"] = out.get("offload", 0.0) + L.micro_batches * 2 * n_local / L.dp * 2 / (C.pcie_gbps * 1e9)
    return out


# ---- enumeration ------------------------------------------------------------------------------------------------
@dataclass
class Search:
    plans: list[Plan]
    refused: dict[str, int]
    examples: dict[str, str]


def enumerate_plans(dims: Dims, C: Cluster, global_batch: int, seq_len: int, *, schedules=None,
                    zero_stages=(0, 1, 2, 3), offload: bool = True, recompute: bool = True,
                    max_micro_batch_size: int = 64, allow_tp_across_nodes: bool = False,
                    trainer3d_only: bool = False) -> Search:
    from trainer3d.parallel.pipeline import SCHEDULES, check_pipeline
    from trainer3d.errors import LayoutError

    N = C.world
    schedules = list(schedules or ["gpipe", "1f1b", "interleaved-1f1b", "zbv"])
    refused: dict[str, int] = {}
    examples: dict[str, str] = {}

    def refuse(reason: str, example: str, count: int = 1) -> None:
        refused[reason] = refused.get(reason, 0) + count
        examples.setdefault(reason, example)

    plans = []
    cfg = replace(dims.gpt_config(), n_positions=max(dims.n_positions, seq_len))
    for tp in divisors(N):
        if dims.n_head % tp:
            refuse("tp does not divide the attention heads", f"tp{tp}, {dims.n_head} heads")
            continue
        if tp > C.gpus_per_node and not allow_tp_across_nodes:
            refuse("tp larger than a node (its all-reduces would cross the network)", f"tp{tp}")
            continue
        for pp in divisors(N // tp):
            dp = N // (tp * pp)
            if global_batch % dp:
                refuse("global batch not divisible by dp", f"dp{dp}, batch {global_batch}")
                continue
            local = global_batch // dp
            sched_opts = [("1f1b", 1)] if pp == 1 else []
            if pp > 1:
                for s in schedules:
                    info = SCHEDULES[s]
                    if info.multi_stage and not info.v_shape:
                        sched_opts += [(s, v) for v in (2, 4) if pp * v <= dims.n_layer]
                    else:
                        sched_opts.append((s, 1))
            for s, v in sched_opts:
                for mbs in divisors(local):
                    if mbs > max_micro_batch_size:
                        break
                    m = local // mbs
                    try:
                        check_pipeline(cfg, pp, s, v, m)
                    except LayoutError as e:
                        refuse("pipeline rule: " + str(e).split(";")[0].split("(")[0].strip(), f"dp{dp} tp{tp} pp{pp} {s} m{m}")
                        continue
                    for z in zero_stages:
                        if z and dp == 1:
                            continue  # nothing to partition over
                        if z and SCHEDULES[s].split_backward:
                            refuse("ZeRO with a split-backward schedule (zero.py refuses it)", f"{s} ZeRO-{z}")
                            continue
                        offloads = [(False, False)]
                        if offload and z >= 1:
                            offloads.append((True, False))
                        if offload and z == 3:
                            offloads.append((True, True))
                        fits_without_offload = set()
                        for off_o, off_p in offloads:
                            for rc in ((False, True) if recompute and not trainer3d_only else (False,)):
                                if off_o and rc in fits_without_offload:
                                    continue  # offloading only costs time when the plan fits without it
                                L = Layout(
                                    dims=Dims(dims.n_layer, dims.n_embd, dims.n_head, dims.vocab, cfg.n_positions),
                                    dp=dp, tp=tp, pp=pp, schedule=s, virtual_stages=v, micro_batches=m,
                                    micro_batch_size=mbs, seq_len=seq_len,
                                    precision="bf16-autocast" if z == 0 else "bf16-mixed",
                                    zero_stage=z, offload_optimizer=off_o, offload_params=off_p, recompute=rc,
                                )
                                ranks = sorted({0, 1 if pp > 1 else 0, pp // 2, max(pp - 2, 0), pp - 1})
                                ests = [estimate_memory(L, r) for r in ranks]
                                mem = max(e.peak for e in ests)
                                host = max(e.offloaded for e in ests)
                                if mem > C.usable_bytes:
                                    refuse("does not fit in GPU memory", f"{L_str(L)}: {gib(mem):.1f} GiB")
                                    continue
                                if host * C.gpus_per_node > C.host_memory_gib * 2**30:
                                    refuse("offloaded state does not fit in host memory", L_str(L))
                                    continue
                                if not off_o:
                                    fits_without_offload.add(rc)
                                p = Plan(L, mem, host, step_times(L, C))
                                if rc:
                                    p.notes.append("needs activation checkpointing (not yet a trainer3d flag)")
                                if cfg.n_positions > MODEL_PRESETS["gpt2"].n_positions:
                                    p.notes.append("needs more than 1024 positions (not a trainer3d flag yet)")
                                plans.append(p)
    plans.sort(key=lambda p: (p.step_time, p.memory))
    return Search(plans, refused, examples)


def L_str(L: Layout) -> str:
    s = f"dp{L.dp} tp{L.tp} pp{L.pp}"
    if L.pp > 1:
        s += f" {L.schedule}" + (f" v{L.virtual_stages}" if L.virtual_stages > 1 else "")
    s += f" m{L.micro_batches}x{L.micro_batch_size} ZeRO-{L.zero_stage}"
    if L.offload_optimizer:
        s += "+offload" + ("(opt,param)" if L.offload_params else "(opt)")
    if L.recompute:
        s += " +recompute"
    return s


def best_distinct(plans: list[Plan], top: int) -> list[Plan]:
    """The best plan of each distinct (dp, tp, pp, schedule, v, ZeRO, offload, recompute), fastest first."""
    seen, out = set(), []
    for p in plans:
        if p.key() in seen:
            continue
        seen.add(p.key())
        out.append(p)
        if len(out) == top:
            break
    return out


def why(p: Plan, best: Plan, rank: int, n_feasible: int, runner_up: Plan | None) -> str:
    """One sentence: why this plan wins, or what it trades against the fastest."""
    def dominant(diffs):
        parts = sorted(diffs.items(), key=lambda kv: -abs(kv[1]))
        return ", ".join(f"{k} {'+' if v > 0 else '-'}{abs(v) / best.step_time:.0%}" for k, v in parts[:3] if abs(v) > 0.005 * best.step_time)

    if rank == 0:
        text = f"fastest of {n_feasible} feasible plans"
        if runner_up is not None:
            diffs = {k: runner_up.times.get(k, 0.0) - p.times.get(k, 0.0) for k in set(p.times) | set(runner_up.times)}
            slower = runner_up.step_time / p.step_time - 1
            text += f"; the next layout ({L_str(runner_up.layout)}) is {slower:.1%} slower: {dominant(diffs) or 'same costs'}"
        return text
    diffs = {k: p.times.get(k, 0.0) - best.times.get(k, 0.0) for k in set(p.times) | set(best.times)}
    text = f"{p.step_time / best.step_time - 1:+.1%} step time vs #1 ({dominant(diffs) or 'same costs'})"
    dm = best.memory - p.memory
    if dm > 0.5 * 2**30:
        text += f"; {gib(dm):.1f} GiB less memory per GPU (more headroom)"
    elif dm < -0.5 * 2**30:
        text += f"; {gib(-dm):.1f} GiB more memory"
    if p.layout.pp == 1 and best.layout.pp > 1:
        text += "; no pipeline (simpler, no bubble)"
    if p.layout.zero_stage == 0 and best.layout.zero_stage > 0:
        text += "; plain DDP (no DeepSpeed)"
    return text


# ---- launch -------------------------------------------------------------------------------------------------
def model_flags(model_name: str | None, dims: Dims) -> list[str]:
    if model_name in MODEL_PRESETS:
        return ["--model", model_name]
    base = MODEL_PRESETS["gpt2"]
    flags = ["--model", "gpt2", "--n-layer", str(dims.n_layer), "--n-embd", str(dims.n_embd),
             "--n-head", str(dims.n_head)]
    if dims.vocab != base.vocab_size:
        flags += ["--vocab-size", str(dims.vocab)]
    return flags


def train_flags(p: Plan, model_name: str | None, ds_path: str | None) -> list[str]:
    L = p.layout
    flags = model_flags(model_name, L.dims) + ["--tp", str(L.tp), "--pp", str(L.pp)]
    if L.pp > 1:
        flags += ["--schedule", L.schedule]
        if L.virtual_stages > 1:
            flags += ["--virtual-stages", str(L.virtual_stages)]
    flags += ["--micro-batches", str(L.micro_batches), "--global-batch", str(L.global_batch),
              "--seq-len", str(L.seq_len)]
    if L.zero_stage:
        flags += ["--deepspeed_config", ds_path or "plan_ds_config.json"]
    return flags


def launch_command(p: Plan, C: Cluster, launcher: str, model_name: str | None, ds_path: str | None) -> str:
    args = " ".join(train_flags(p, model_name, ds_path))
    if launcher == "torchrun":
        rdzv = " --rdzv_backend c10d --rdzv_endpoint $MASTER_ADDR:29500" if C.nodes > 1 else ""
        return f"torchrun --nnodes {C.nodes} --nproc_per_node {C.gpus_per_node}{rdzv} launch/train_gpt2.py {args}"
    if launcher == "deepspeed":
        hosts = " --hostfile hostfile" if C.nodes > 1 else ""
        return f"deepspeed --num_nodes {C.nodes} --num_gpus {C.gpus_per_node}{hosts} launch/train_gpt2.py {args}"
    if launcher == "sbatch":
        return "\n".join([
            "#!/bin/bash",
            f"#SBATCH --nodes={C.nodes}",
            f"#SBATCH --ntasks-per-node={C.gpus_per_node}",
            f"#SBATCH --gpus-per-node={C.gpus_per_node}",
            "#SBATCH --cpus-per-task=8",
            'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            "export MASTER_PORT=29500",
            f"srun python launch/train_gpt2.py {args}",
        ])
    raise ValueError(f"unknown launcher {launcher!r}")


# ---- command line -----------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer3d.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model (a preset, or sizes)")
    m.add_argument("--model", default=None, help=f"one of {', '.join(list(MODEL_PRESETS) + list(PLAN_MODELS))}")
    m.add_argument("--n-layer", type=int)
    m.add_argument("--n-embd", type=int)
    m.add_argument("--n-head", type=int)
    m.add_argument("--vocab", type=int, default=None)
    m.add_argument("--seq-len", type=int, default=1024)
    c = p.add_argument_group("cluster")
    c.add_argument("--preset-cluster", choices=list(CLUSTERS), default=None, help="defaults for the flags below")
    c.add_argument("--nodes", type=int, default=1)
    c.add_argument("--gpus-per-node", type=int, default=None)
    c.add_argument("--gpu-memory-gib", type=float, default=None)
    c.add_argument("--intra-node-gbps", type=float, default=None, help="GB/s per GPU inside a node (ring bus bandwidth)")
    c.add_argument("--inter-node-gbps", type=float, default=None, help="GB/s per GPU across nodes")
    c.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak per GPU")
    c.add_argument("--mfu", type=float, default=0.5, help="fraction of peak the kernels reach (compute only)")
    c.add_argument("--overlap", type=float, default=0.5,
                   help="fraction of a compute window that dp communication can hide behind (0: none, 1: perfect)")
    c.add_argument("--pcie-gbps", type=float, default=25.0, help="host <-> GPU GB/s, for offload")
    c.add_argument("--host-memory-gib", type=float, default=1024.0, help="per node, for offload")
    b = p.add_argument_group("batch")
    b.add_argument("--global-batch", type=int, default=None, help="sequences per step")
    b.add_argument("--global-batch-tokens", type=int, default=None, help="tokens per step (e.g. 524288)")
    s = p.add_argument_group("search")
    s.add_argument("--schedules", nargs="+", default=None, help="pipeline schedules to consider")
    s.add_argument("--zero-stages", type=int, nargs="+", default=[0, 1, 2, 3])
    s.add_argument("--no-offload", action="store_true")
    s.add_argument("--no-recompute", action="store_true", help="leave out activation checkpointing")
    s.add_argument("--trainer3d-only", action="store_true", help="only what trainer3d can run today (no recompute)")
    s.add_argument("--max-micro-batch-size", type=int, default=64)
    s.add_argument("--top", type=int, default=5)
    o = p.add_argument_group("output")
    o.add_argument("--pick", type=int, default=1, help="which plan (1 = best) to write/launch")
    o.add_argument("--write-ds-config", default=None, metavar="PATH", help="write the DeepSpeed JSON of the pick")
    o.add_argument("--launcher", choices=["torchrun", "deepspeed", "sbatch"], default="torchrun")
    o.add_argument("--json", action="store_true", help="print the plans as JSON")
    o.add_argument("--evaluate", default=None, metavar="LAYOUT",
                   help="also estimate one layout, e.g. tp=8,pp=16,schedule=1f1b,mbs=1,zero=0,recompute=1 "
                        "(dp follows from the cluster; keys: tp pp schedule v mbs zero offload recompute)")
    return p


def resolve(args) -> tuple[str | None, Dims, Cluster, int]:
    if args.model in PLAN_MODELS:
        dims = PLAN_MODELS[args.model]
    elif args.model in MODEL_PRESETS or args.model is None:
        base = MODEL_PRESETS[args.model or "gpt2"]
        dims = Dims.of(base)
    else:
        raise SystemExit(f"plan: unknown --model {args.model!r}; choose one of {', '.join(list(MODEL_PRESETS) + list(PLAN_MODELS))} or give sizes.")
    dims = Dims(args.n_layer or dims.n_layer, args.n_embd or dims.n_embd, args.n_head or dims.n_head,
                args.vocab or dims.vocab, max(dims.n_positions, args.seq_len))
    if dims.n_embd % dims.n_head:
        raise SystemExit(f"plan: --n-embd {dims.n_embd} is not a multiple of --n-head {dims.n_head}.")
    preset = CLUSTERS.get(args.preset_cluster, CLUSTERS["h100"])
    val = lambda name: getattr(args, name) if getattr(args, name) is not None else preset[name]  # noqa: E731
    C = Cluster(nodes=args.nodes, gpus_per_node=val("gpus_per_node"), gpu_memory_gib=val("gpu_memory_gib"),
                peak_tflops=val("peak_tflops"), intra_node_gbps=val("intra_node_gbps"),
                inter_node_gbps=val("inter_node_gbps"), pcie_gbps=args.pcie_gbps, mfu=args.mfu, overlap=args.overlap,
                host_memory_gib=args.host_memory_gib)
    if args.global_batch_tokens is not None:
        if args.global_batch_tokens % args.seq_len:
            raise SystemExit(f"plan: --global-batch-tokens {args.global_batch_tokens} is not a multiple of --seq-len {args.seq_len}.")
        gb = args.global_batch_tokens // args.seq_len
    else:
        gb = args.global_batch or 8 * C.world
    return args.model, dims, C, gb


def parse_layout(text: str, dims: Dims, C: Cluster, global_batch: int, seq_len: int) -> Layout:
    kv = dict(item.split("=", 1) for item in text.replace(" ", "").split(",") if item)
    tp, pp = int(kv.get("tp", 1)), int(kv.get("pp", 1))
    if C.world % (tp * pp):
        raise SystemExit(f"plan: --evaluate tp×pp = {tp * pp} does not divide {C.world} GPUs.")
    dp = C.world // (tp * pp)
    mbs = int(kv.get("mbs", 1))
    if global_batch % (dp * mbs):
        raise SystemExit(f"plan: --evaluate: global batch {global_batch} does not split into dp={dp} × mbs={mbs}.")
    z = int(kv.get("zero", 0))
    off = kv.get("offload", "none")
    return Layout(
        dims=dims, dp=dp, tp=tp, pp=pp, schedule=kv.get("schedule", "1f1b"), virtual_stages=int(kv.get("v", 1)),
        micro_batches=global_batch // (dp * mbs), micro_batch_size=mbs, seq_len=seq_len,
        precision="bf16-autocast" if z == 0 else "bf16-mixed", zero_stage=z,
        offload_optimizer=off in ("opt", "all"), offload_params=off == "all", recompute=kv.get("recompute", "0") in ("1", "true"),
    )


def evaluate(L: Layout, C: Cluster) -> Plan:
    ranks = sorted({0, 1 if L.pp > 1 else 0, L.pp // 2, max(L.pp - 2, 0), L.pp - 1})
    ests = [estimate_memory(L, r) for r in ranks]
    p = Plan(L, max(e.peak for e in ests), max(e.offloaded for e in ests), step_times(L, C))
    if p.memory > C.usable_bytes:
        p.notes.append(f"does NOT fit: {gib(p.memory):.1f} GiB > {gib(C.usable_bytes):.1f} GiB usable")
    return p


def format_plans(shown: list[Plan], search: Search, C: Cluster) -> str:
    rows = []
    for i, p in enumerate(shown):
        L = p.layout
        total = p.step_time
        br = " ".join(f"{k} {v / total:.0%}" for k, v in p.times.items() if v / total >= 0.005)
        from trainer3d.train.metrics import flops_per_token

        tok = L.global_batch * L.seq_len
        mfu = flops_per_token(L.dims.gpt_config(), L.seq_len) * tok / (total * C.world * C.peak_tflops * 1e12)
        rows.append([str(i + 1), L_str(L), f"{gib(p.memory):.1f}", f"{gib(p.host):.1f}" if p.host else "-",
                     f"{total:.3f}", f"{tok / total:,.0f}", f"{mfu:.1%}", br])
    header = ["#", "layout (m = micro-batches x size)", "GiB/GPU", "host GiB/GPU", "step s", "tokens/s", "MFU", "time split"]
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    name, dims, C, gb = resolve(args)
    search = enumerate_plans(
        dims, C, gb, args.seq_len, schedules=args.schedules, zero_stages=tuple(args.zero_stages),
        offload=not args.no_offload, recompute=not (args.no_recompute or args.trainer3d_only),
        max_micro_batch_size=args.max_micro_batch_size, trainer3d_only=args.trainer3d_only,
    )
    n_params = dims.gpt_config().num_params()
    print(f"model: {name or 'custom'} L{dims.n_layer} d{dims.n_embd} h{dims.n_head} vocab {dims.vocab} "
          f"({n_params / 1e9:.2f}B params), seq {args.seq_len}, global batch {gb} sequences ({gb * args.seq_len:,} tokens)")
    print(f"cluster: {C.nodes} x {C.gpus_per_node} GPUs, {C.gpu_memory_gib:g} GiB ({C.reserve_gib:g} reserved), "
          f"{C.peak_tflops:g} TFLOP/s peak at {C.mfu:.0%} kernel efficiency, {C.intra_node_gbps:g} GB/s in a node, "
          f"{C.inter_node_gbps:g} GB/s across")
    if not search.plans:
        print("no feasible plan. Refused:")
        for reason, n in sorted(search.refused.items(), key=lambda kv: -kv[1]):
            print(f"  {n:>7} {reason} (e.g. {search.examples[reason]})")
        return 1
    shown = best_distinct(search.plans, args.top)
    if args.json:
        print(json.dumps([dict(layout=L_str(p.layout), memory_gib=gib(p.memory), host_gib=gib(p.host),
                               step_s=p.step_time, times=p.times, notes=p.notes) for p in shown], indent=1))
    else:
        print(format_plans(shown, search, C))
        runner_up = shown[1] if len(shown) > 1 else None
        print()
        for i, p in enumerate(shown):
            note = f" [{'; '.join(p.notes)}]" if p.notes else ""
            print(f"#{i + 1}: {why(p, shown[0], i, len(search.plans), runner_up)}{note}")
        print(f"\nrefused {sum(search.refused.values())} candidates:")
        for reason, n in sorted(search.refused.items(), key=lambda kv: -kv[1]):
            print(f"  {n:>7} {reason} (e.g. {search.examples[reason]})")
    if args.evaluate:
        ev = evaluate(parse_layout(args.evaluate, dims, C, gb, args.seq_len), C)
        faster = sum(1 for p in search.plans if p.step_time < ev.step_time)
        print(f"\nevaluated: {args.evaluate}")
        print(format_plans([ev], search, C))
        print(f"  {why(ev, shown[0], 1, len(search.plans), None)}; {faster} feasible plans are estimated faster"
              + (f" [{'; '.join(ev.notes)}]" if ev.notes else ""))
    pick = shown[min(max(args.pick, 1), len(shown)) - 1]
    L = pick.layout
    if args.write_ds_config:
        if L.zero_stage == 0:
            print(f"\nplan #{args.pick} uses DDP (ZeRO-0): no DeepSpeed JSON needed; not writing {args.write_ds_config}")
        else:
            cfg = deepspeed_config(L.zero_stage, L.offload_optimizer, L.offload_params, L.micro_batch_size,
                                   L.micro_batches, L.dp, "bf16-mixed", L.dims.n_embd)
            with open(args.write_ds_config, "w") as f:
                json.dump(cfg, f, indent=2)
            print(f"\nwrote {args.write_ds_config} (ZeRO-{L.zero_stage})")
    print(f"\nlaunch ({args.launcher}) for #{args.pick}:")
    print(launch_command(pick, C, args.launcher, name if name in MODEL_PRESETS else None, args.write_ds_config))
    if pick.notes:
        print("note: " + "; ".join(pick.notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
