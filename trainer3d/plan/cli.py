"""The layout planner: `python -m trainer3d.plan`.

Given a model, a cluster and a global batch, enumerate every layout trainer3d can run (dp, tp, pp, cp, ep for a
mixture of experts, schedule, virtual stages, micro-batches, ZeRO stage, offload, activation checkpointing), estimate memory per GPU and step
time with the cost model in trainer3d/plan/ (memory.py, comm.py, step_time.py: the one bench/comm_volume.py and
bench/memory.py check against measurements), refuse what does not fit or cannot run, and print the best few with
the reason each wins. Optionally write the DeepSpeed JSON and print the launch command for a chosen plan.

    python -m trainer3d.plan --model gpt2-xl --nodes 2 --gpus-per-node 8 --gpu-memory-gib 80 \\
        --peak-tflops 989 --global-batch-tokens 524288 --seq-len 1024
    python -m trainer3d.plan --preset-cluster a100-80g --nodes 128 --model gpt3-175b --seq-len 2048 \\
        --global-batch 1536 --launcher sbatch --write-ds-config plan.json

Step time = compute (model FLOPs / GPUs / (peak × --mfu), × 4/3 with recomputation, × the busiest pipeline rank's
share) + pipeline bubble (schedule formulas; see bench/pipeline_bubble.py) + exposed communication (payloads
from comm.analytic_comm, ring factors, tp over the intra-node bandwidth, dp and pp over the inter-node one
when their groups span nodes; DDP's and ZeRO's gradient reduction overlaps the backward it can overlap) + CPU
offload (PCIe transfers and CPU Adam) + with --fp8, torchao's casts (per token and linear width, fitted to an
H200). It is a model for ranking layouts, not a promise of seconds.

A mixture of experts (qwen3-30b-a3b, mixtral-8x7b, ...) is planned as the trainer runs it: parameters counted layer by
layer with each ep rank's n_experts/ep experts (under ZeRO their state partitioned over edp), the active FLOPs (MFU counts those), and the
all-to-alls of every MoE layer priced on the links the ep group spans:

    python -m trainer3d.plan --model mixtral-8x7b --nodes 8 --seq-len 4096 --global-batch 256 \
        --evaluate tp=1,pp=4,ep=8,schedule=interleaved-1f1b,v=8,mbs=1
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from trainer3d.config import SIZE_FLAGS
from trainer3d.errors import ArgumentParser, UsageError, report
from trainer3d.fsio import write_text_atomic
from trainer3d.models import MODEL_PRESETS, family_of
from trainer3d.parallel.fp8 import RECIPES as FP8_RECIPES
from trainer3d.parallel.lora import LoRASpec
from trainer3d.plan.candidate import describe, gib
from trainer3d.plan.cluster import CLUSTERS, Cluster
from trainer3d.plan.report import DS_CONFIG_PATH, format_plans, launch_command, plan_deepspeed_config, why
from trainer3d.plan.search import best_distinct, enumerate_plans, evaluate, parse_layout, representative_ranks
from trainer3d.plan.state_memory import worst_state_memory

def state_line(p, label: str) -> str:
    """The model state outside a step, for a plan's worst pipeline rank (plan/state_memory.py)."""
    s = worst_state_memory(p.candidate, representative_ranks(p.candidate.pp))
    return (f"{label}: model state outside the step, worst rank (GiB): start-up {gib(s.startup_device):.1f} on the GPU "
            f"(+{gib(s.startup_host):.1f} on the host for the largest tensor's initial value); a save "
            f"writes {gib(s.save_written):.2f} and adds {gib(s.save_host):.2f} of host memory; a resume reads "
            f"{gib(s.resume_read):.1f}")


def active_params(cfg) -> str:
    """', N active' for a mixture of experts (what a token uses: the FLOPs and MFU count these), else ''."""
    return f", {cfg.num_params(active=True) / 1e9:.2f}B active" if cfg.moe is not None else ""


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m trainer3d.plan", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model (a preset, or sizes)")
    m.add_argument("--model", default=None, help=f"one of {', '.join(MODEL_PRESETS)}")
    m.add_argument("--n-layer", type=int)
    m.add_argument("--n-embd", type=int)
    m.add_argument("--n-head", type=int)
    m.add_argument("--n-kv-heads", type=int, help="Llama family: key/value heads")
    m.add_argument("--ffn-hidden", type=int, help="Llama family: SwiGLU's width")
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
    c.add_argument("--calibrate", action="store_true",
                   help="measure this machine (matmuls at the model's shapes, each link's latency and bandwidth, the "
                        "overlap) under torchrun on every rank of a node, cache it, and stop (plan/calibrate.py)")
    c.add_argument("--calibrated", action="store_true",
                   help="plan with this machine's cached calibration instead of --peak-tflops/--mfu/--overlap and "
                        "the bandwidths (the cluster's shape still comes from --nodes and --gpus-per-node)")
    c.add_argument("--precision", choices=("fp32", "bf16"), default=None,
                   help="with --calibrate/--calibrated: the matmuls' dtype (default bf16 on a GPU, fp32 on a CPU)")
    c.add_argument("--host-memory-gib", type=float, default=1024.0, help="per node, for offload")
    b = p.add_argument_group("batch")
    b.add_argument("--global-batch", type=int, default=None, help="sequences per step")
    b.add_argument("--global-batch-tokens", type=int, default=None, help="tokens per step (e.g. 524288)")
    s = p.add_argument_group("search")
    s.add_argument("--schedules", nargs="+", default=None, help="pipeline schedules to consider")
    s.add_argument("--zero-stages", type=int, nargs="+", default=[0, 1, 2, 3])
    s.add_argument("--no-offload", action="store_true")
    s.add_argument("--no-recompute", action="store_true", help="leave out activation checkpointing")
    s.add_argument("--fp8", nargs="?", const="rowwise", default=None, choices=FP8_RECIPES,
                   help="every plan with the trainer's --fp8 of this recipe (default rowwise): its eligible matmuls at "
                   "twice the bf16 peak, plus torchao's casts (Cluster.fp8_cast_s, times FP8_CAST_SHARE's recipe)")
    s.add_argument("--lora-rank", type=int, default=0, metavar="R",
                   help="every plan training LoRA adapters of rank R on all-linear over a frozen base (the trainer's "
                        "--lora-rank): gradients and AdamW state for the adapters only, no weight gradient of the base")
    s.add_argument("--max-micro-batch-size", type=int, default=64)
    s.add_argument("--cp-sizes", type=int, nargs="+", default=None,
                   help="context-parallel sizes to consider (default: 1 and the powers of two that leave each rank at "
                        "least 4096 tokens of a sequence)")
    s.add_argument("--top", type=int, default=5)
    o = p.add_argument_group("output")
    o.add_argument("--pick", type=int, default=1, help="which plan (1 = best) to write/launch")
    o.add_argument("--write-ds-config", default=None, metavar="PATH", help="write the DeepSpeed JSON of the pick")
    o.add_argument("--launcher", choices=["torchrun", "deepspeed", "sbatch"], default="torchrun")
    o.add_argument("--json", action="store_true", help="print the plans as JSON")
    o.add_argument("--evaluate", default=None, metavar="LAYOUT",
                   help="also estimate one layout, e.g. tp=8,pp=16,schedule=1f1b,mbs=1,zero=0,recompute=1 "
                        "(dp follows from the cluster; keys: tp pp cp ep schedule v mbs zero offload recompute sp fp8 "
                        "lora, the last a LoRA rank as --lora-rank's)")
    return p


def cluster_from_preset(preset: str, nodes: int, **overrides) -> Cluster:
    """A cluster of `nodes` nodes of a preset's hardware, any field overridden."""
    return Cluster(nodes=nodes, **{**CLUSTERS[preset], **overrides})


def resolve(args) -> tuple[str | None, object, Cluster, int]:
    """(model name, model config, cluster, global batch in sequences) from the flags."""
    if args.model in MODEL_PRESETS or args.model is None:
        base = MODEL_PRESETS[args.model or "gpt2"]
    else:
        raise UsageError(f"unknown --model {args.model!r}; choose one of {', '.join(MODEL_PRESETS)} or give sizes.")
    sizes = {k: getattr(args, k) for k in SIZE_FLAGS if getattr(args, k, None) is not None}  # (no --n-positions here)
    unknown = sorted(set(sizes) - set(base.__dataclass_fields__))
    if unknown:
        raise UsageError(f"--{unknown[0].replace('_', '-')} does not size a {base.family} model; drop it.")
    cfg = replace(base, **sizes, vocab_size=args.vocab or base.vocab_size,
                  n_positions=max(base.n_positions, args.seq_len))
    family_of(cfg).check(cfg, 1)
    given = {k: getattr(args, k) for k in CLUSTERS["h100"] if getattr(args, k) is not None}
    C = cluster_from_preset(args.preset_cluster or "h100", args.nodes, **given, pcie_gbps=args.pcie_gbps, mfu=args.mfu,
                            overlap=args.overlap, host_memory_gib=args.host_memory_gib)
    if args.global_batch_tokens is not None:
        if args.global_batch_tokens % args.seq_len:
            raise UsageError(f"--global-batch-tokens {args.global_batch_tokens} is not a multiple of --seq-len {args.seq_len}.")
        gb = args.global_batch_tokens // args.seq_len
    else:
        gb = args.global_batch or 8 * C.world
    return args.model or "gpt2", cfg, C, gb


def with_calibration(C: Cluster, precision: str | None) -> Cluster:
    """The cluster with this machine's cached measurements (plan/calibrate.py), or a one-sentence error."""
    import torch

    from trainer3d.plan import calibrate

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = precision or ("bf16" if device.type == "cuda" else "fp32")
    calib = calibrate.load(device, C.gpus_per_node, dtype)
    if calib is None:
        path = calibrate.cache_path(calibrate.device_name(device), C.gpus_per_node, dtype)
        raise UsageError(f"no calibration at {path}; run `torchrun --nproc_per_node {C.gpus_per_node} -m "
                         "trainer3d.plan --calibrate --model ...` on this machine first.")
    print(f"calibration: {calib.describe()}")
    return calibrate.apply(C, calib)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        name, cfg, C, gb = resolve(args)
    except UsageError as e:
        return report(e)
    if args.calibrate:  # under torchrun: it reports its own errors, once
        from trainer3d.plan import calibrate

        return calibrate.run(cfg, args.seq_len, args.precision)
    try:
        if args.calibrated:
            C = with_calibration(C, args.precision)
        evaluated = parse_layout(args.evaluate, cfg, C, gb, args.seq_len) if args.evaluate else None
    except UsageError as e:
        return report(e)
    search = enumerate_plans(
        cfg, C, gb, args.seq_len, schedules=args.schedules, zero_stages=tuple(args.zero_stages),
        offload=not args.no_offload, recompute=not args.no_recompute, max_micro_batch_size=args.max_micro_batch_size,
        cp_sizes=tuple(args.cp_sizes) if args.cp_sizes else None, fp8=args.fp8,
        lora=LoRASpec(args.lora_rank, 2.0 * args.lora_rank) if args.lora_rank else None,
    )
    kv = f" kv{cfg.n_kv_heads}" if hasattr(cfg, "n_kv_heads") else ""
    print(f"model: {name or 'custom'} ({cfg.family}) L{cfg.n_layer} d{cfg.n_embd} h{cfg.n_head}{kv} vocab {cfg.vocab_size} "
          f"({cfg.num_params() / 1e9:.2f}B params{active_params(cfg)}), seq {args.seq_len}, global batch {gb} sequences "
          f"({gb * args.seq_len:,} tokens)")
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
        print(json.dumps([dict(layout=describe(p.candidate), memory_gib=gib(p.memory), host_gib=gib(p.host),
                               step_s=p.step_time, times=p.times, notes=p.notes) for p in shown], indent=1))
    else:
        print(format_plans(shown, C))
        runner_up = shown[1] if len(shown) > 1 else None
        print()
        for i, p in enumerate(shown):
            note = f" [{'; '.join(p.notes)}]" if p.notes else ""
            print(f"#{i + 1}: {why(p, shown[0], i, len(search.plans), runner_up)}{note}")
        print(state_line(shown[0], "\n#1"))
        print(f"\nrefused {sum(search.refused.values())} candidates:")
        for reason, n in sorted(search.refused.items(), key=lambda kv: -kv[1]):
            print(f"  {n:>7} {reason} (e.g. {search.examples[reason]})")
    if evaluated is not None:
        ev = evaluate(evaluated, C)
        faster = sum(1 for p in search.plans if p.step_time < ev.step_time)
        print(f"\nevaluated: {args.evaluate}")
        print(format_plans([ev], C))
        print(f"  {why(ev, shown[0], 1, len(search.plans), None)}; {faster} feasible plans are estimated faster"
              + (f" [{'; '.join(ev.notes)}]" if ev.notes else ""))
        print(state_line(ev, "  evaluated"))
    pick = shown[min(max(args.pick, 1), len(shown)) - 1]
    if args.write_ds_config:
        if pick.candidate.zero_stage == 0:
            print(f"\nplan #{args.pick} uses DDP (ZeRO-0): no DeepSpeed JSON needed; not writing {args.write_ds_config}")
        else:
            write_text_atomic(args.write_ds_config, json.dumps(plan_deepspeed_config(pick), indent=2))
            print(f"\nwrote {args.write_ds_config} (ZeRO-{pick.candidate.zero_stage})")
    print(f"\nlaunch ({args.launcher}) for #{args.pick}:")
    print(launch_command(pick, C, args.launcher, name if name in MODEL_PRESETS else None, args.write_ds_config))
    if pick.candidate.zero_stage and not args.write_ds_config:
        print(f"(the command reads {DS_CONFIG_PATH}: add --write-ds-config {DS_CONFIG_PATH} to write it)")
    if pick.notes:
        print("note: " + "; ".join(pick.notes))
    return 0
