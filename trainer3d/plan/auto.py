"""`--layout auto`: the layout planner run at launch, on every rank alike, before any process group.

Every rank computes the same pick with no collective, so the inputs are only what every rank reads alike: the flags,
the model, the world size, ranks per node (the launcher's variables), memory per rank (the device's total, never its
free memory; on CPU the host's memory over its ranks; or --device-memory-gib) and a peak per device. The machine
becomes the planner's Cluster (`machine_cluster`; Machine.measured: a calibration's constants), enumerate_plans
searches it with the explicit flags as constraints, and the fastest plan the trainer's own rules accept wins; the
runner-up and the reason (report.why) go with it into the TrainConfig (`layout_choice`: meta.json, W&B).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Mapping

from trainer3d.config import TrainConfig
from trainer3d.distributed.collectives import all_gather_object
from trainer3d.errors import ConfigError
from trainer3d.parallel.batch import global_batch_of
from trainer3d.parallel.expert_parallel import check_expert_parallel
from trainer3d.parallel.lora import LoRASpec
from trainer3d.parallel.pipeline import pipeline_problem
from trainer3d.plan.candidate import Candidate, describe, gib
from trainer3d.plan.cluster import CLUSTERS, Cluster
from trainer3d.plan.report import deepspeed_config, why
from trainer3d.plan.search import Plan, cp_problem, enumerate_plans

# A CPU rank's nominal numbers: a core's fp32 rate, gloo over loopback. They rank layouts by the model's proportions
# (compute, bubble, communication); they are no CPU's measured seconds. Keys are Cluster fields, as a calibration's.
CPU_CONSTANTS = dict(peak_tflops=0.05, intra_node_gbps=2.0, inter_node_gbps=1.25, pcie_gbps=10.0, reserve_gib=0.5)
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zbv")  # the planner's default search (any other by --schedule)
AXES = ("tp", "pp", "cp", "ep", "schedule", "virtual_stages", "micro_batches", "recompute")


@dataclass(frozen=True)
class Machine:
    """What the planner is told about the machine: the same on every rank of a homogeneous job."""

    world: int
    ranks_per_node: int
    device: str  # "cuda" or "cpu"
    memory_gib: float  # per rank
    peak_tflops: float | None  # per rank, in the run's precision; None: the device's preset or CPU_CONSTANTS
    host_memory_gib: float  # per node
    name: str = ""  # the device's name, for the log
    # Cluster fields (mfu, overlap, intra/inter_node_gbps, pcie_gbps, ...) measured on this machine, replacing the
    # presets: where a calibration's numbers go
    measured: dict[str, object] = dataclasses.field(default_factory=dict)
    calibrated: str = ""  # when the calibration was measured ("": none, the presets' constants)


def ranks_per_node(world: int, environ: Mapping[str, str]) -> int:
    """From the launcher: torchrun's LOCAL_WORLD_SIZE, DeepSpeed's LOCAL_SIZE, SLURM's tasks per node, Open MPI's local
    size; else one node. Clamped to a divisor of the world (the planner's nodes are whole)."""
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE",
                "OMPI_COMM_WORLD_LOCAL_SIZE"):
        text = environ.get(key, "").split("(")[0]  # SLURM may say "4(x2)"
        if text.isdigit() and int(text) > 0:
            return math.gcd(world, int(text))
    return world


def read_machine(world: int, local_rank: int = 0, environ: Mapping[str, str] = os.environ,
                 memory_gib: float | None = None, peak_tflops: float | None = None) -> Machine:
    """This process's machine: on CUDA the total memory of its GPU (its properties: no context is created), on CPU
    the host's physical memory over the node's ranks; `memory_gib` (--device-memory-gib) wins over both."""
    import torch

    rpn = ranks_per_node(world, environ)
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        props = torch.cuda.get_device_properties(0 if count == 1 else local_rank % count)
        return Machine(world, rpn, "cuda", memory_gib or props.total_memory / 2**30, peak_tflops, host, props.name)
    return Machine(world, rpn, "cpu", memory_gib or host / rpn, peak_tflops, host, "cpu")


def machine_cluster(m: Machine) -> Cluster:
    """The planner's Cluster for `m`: a GPU's preset by name (A100, H200, else H100's numbers), CPU_CONSTANTS on a CPU;
    the machine's `measured` constants replace them."""
    if m.device == "cpu":
        base = dict(CPU_CONSTANTS)
    else:
        preset = "a100-80g" if "A100" in m.name else "h200" if "H200" in m.name else "h100"
        base = {k: v for k, v in CLUSTERS[preset].items() if k != "gpus_per_node"}
    base.update(gpu_memory_gib=m.memory_gib, host_memory_gib=m.host_memory_gib)
    if m.peak_tflops:
        base["peak_tflops"] = m.peak_tflops
    base.update(m.measured)
    return Cluster(nodes=m.world // m.ranks_per_node, gpus_per_node=m.ranks_per_node, **base)


def user_json(cfg: TrainConfig) -> dict | None:
    """The user's DeepSpeed JSON (None: none, or `auto`)."""
    from trainer3d.zero.config import load_ds_json

    ds = cfg.deepspeed_config
    return None if ds is None or (isinstance(ds, str) and ds.lower() == "auto") else load_ds_json(ds)[0]


def zero_mode(cfg: TrainConfig) -> str:
    """'none' (DDP only), 'auto' (--deepspeed_config auto: the JSON is written from the pick), 'json' (a JSON whose
    zero_optimization is "auto": that section from the pick) or 'fixed' (a JSON that sets ZeRO itself)."""
    ds = user_json(cfg)
    if ds is None:
        return "none" if cfg.deepspeed_config is None else "auto"
    return "json" if str(ds.get("zero_optimization", "")).lower() == "auto" else "fixed"


def json_batch(cfg: TrainConfig) -> dict[str, int]:
    """A user JSON's concrete batch values (zero/config.py lets them win over the flags): constraints of the plan."""
    ds = user_json(cfg) or {}
    keys = {"train_batch_size": "global_batch", "train_micro_batch_size_per_gpu": "micro_batch_size",
            "gradient_accumulation_steps": "micro_batches"}
    return {name: ds[k] for k, name in keys.items() if isinstance(ds.get(k), int)}


def zero_stages(cfg: TrainConfig, zero: str) -> tuple[int, ...]:
    """The ZeRO stages to plan: 0 (DDP) without a JSON, the JSON's own stage, or all four where asked to choose."""
    if zero == "fixed":
        return (int((user_json(cfg).get("zero_optimization") or {}).get("stage", 0)),)
    return (0,) if zero == "none" else (0, 1, 2, 3)


def satisfies(c: Candidate, cfg: TrainConfig, zero: str) -> bool:
    """The explicit flags hold for `c` (recompute: full is the planner's True; none and selective its False), and a
    user JSON's batch values."""
    for axis in AXES:
        if not cfg.given(axis):
            continue
        value = c.recompute if axis == "recompute" else getattr(c, axis)
        wanted = cfg.recompute == "full" if axis == "recompute" else getattr(cfg, axis)
        if value != wanted and not (axis == "schedule" and c.pp == 1):
            return False
    if cfg.sequence_parallel and c.tp == 1 or any(getattr(c, k) != v for k, v in json_batch(cfg).items()):
        return False
    return not (zero == "json" and c.zero_stage == 0 and c.ep > 1)  # DeepSpeed's ZeRO-0 runs no ep (setup.py)


def trainer_problem(c: Candidate, mcfg, seq_len: int) -> str | None:
    """The trainer's own rules for a plan (the planner uses the same ones; this is the last word)."""
    problem = pipeline_problem(mcfg, c.pp, c.schedule, c.virtual_stages, c.micro_batches, c.sequence_parallel)
    if problem is None and c.cp > 1 and cp_problem(mcfg, c.tp, c.cp):
        return cp_problem(mcfg, c.tp, c.cp)
    return problem[1] if problem else check_expert_parallel(mcfg, c.ep, c.tp, seq_len, c.cp)


def search(cfg: TrainConfig, mcfg, C: Cluster, zero: str, device: str):
    """enumerate_plans over what the flags leave open: the given tp, pp, cp and schedule narrow the search itself,
    the rest filters its plans. An fp32 run (a CPU's) is priced in fp32, a 16-bit one as the planner prices GPUs."""
    fixed = {a: getattr(cfg, a) for a in ("tp", "pp") if cfg.given(a)}
    cp_sizes = (cfg.cp,) if cfg.given("cp") else None
    pooled = cfg.moe_aux_loss == "hf" and cfg.moe_aux_loss_coef  # transformers' pooled loss: one whole stage a rank
    if pooled:
        fixed, cp_sizes = dict(tp=1, pp=1), (1,)
    fp32 = cfg.resolved_precision(device) == "fp32"
    return enumerate_plans(
        mcfg, C, json_batch(cfg).get("global_batch", global_batch_of(cfg)), cfg.seq_len,
        schedules=[cfg.schedule] if cfg.given("schedule") else SCHEDULES,
        zero_stages=zero_stages(cfg, zero), offload=zero in ("auto", "json"),
        recompute=not pooled and (not cfg.given("recompute") or cfg.recompute == "full"), fixed=fixed,
        cp_sizes=cp_sizes, precision="fp32" if fp32 else None, fp8=cfg.fp8, lora=LoRASpec.of(cfg))


def choose(cfg: TrainConfig, mcfg, m: Machine) -> tuple[Plan, Plan | None, dict]:
    """(pick, runner-up, the record of the choice). The runner-up: the best plan that differs in more than its
    micro-batch split (report.best_distinct's key). Refuses with one sentence where nothing fits."""
    C, zero = machine_cluster(m), zero_mode(cfg)
    found = search(cfg, mcfg, C, zero, m.device)
    ok = ranked([p for p in found.plans if satisfies(p.candidate, cfg, zero)])
    valid = (p for p in ok if trainer_problem(p.candidate, mcfg, cfg.seq_len) is None)
    pick = next(valid, None)
    if pick is None:
        raise ConfigError(refusal(cfg, mcfg, m, found, len(found.plans)))
    runner_up = next((p for p in valid if p.key() != pick.key()), None)
    given = {a: getattr(cfg, a) for a in AXES if cfg.given(a)}
    record = dict(
        pick=describe(pick.candidate), why=why(pick, pick, 0, len(ok), runner_up),
        runner_up=describe(runner_up.candidate) if runner_up else None, feasible=len(ok),
        refused=sum(found.refused.values()), constraints=given, zero=zero,
        estimate=estimate(pick), runner_up_estimate=estimate(runner_up) if runner_up else None,
        machine=dict(dataclasses.asdict(m), nodes=C.nodes,
                     constants="measured" if m.measured else "cpu-nominal" if m.device == "cpu" else "preset"))
    return pick, runner_up, record


def ranked(plans: list[Plan]) -> list[Plan]:
    """Fastest first; among plans the model prices alike (to 1e-6), fewer micro-batches first: the model charges
    nothing per micro-batch, and a larger one runs larger matrix products; then the least memory."""
    if not plans:
        return plans
    best = plans[0].step_time
    return sorted(plans, key=lambda p: (round(p.step_time / best, 6), p.candidate.micro_batches, p.memory))


def estimate(p: Plan) -> dict:
    return {"step_s": p.step_time, "memory_gib": gib(p.memory), "host_gib": gib(p.host)}


def refusal(cfg: TrainConfig, mcfg, m: Machine, found, feasible: int) -> str:
    """One sentence: why no layout of this world fits, and what to change."""
    given = ", ".join(f"--{a.replace('_', '-')} {getattr(cfg, a)}" for a in AXES if cfg.given(a))
    head = (f"--layout auto finds no layout of {m.world} process{'es' if m.world > 1 else ''} for this "
            f"{mcfg.num_params() / 1e6:.1f}M-parameter model at global batch {global_batch_of(cfg)} × {cfg.seq_len} "
            f"tokens in {m.memory_gib:.3g} GiB per rank")
    if feasible:
        return f"{head} that keeps {given} ({feasible} layouts fit without them); drop or change those flags."
    reason, n = max(found.refused.items(), key=lambda kv: kv[1]) if found.refused else ("nothing to try", 0)
    return (f"{head}{' with ' + given if given else ''} ({n} refused because {reason}, e.g. "
            f"{found.examples.get(reason, '-')}); launch more processes, lower --global-batch or --seq-len, or give "
            "--device-memory-gib if the memory read is wrong.")


def apply_pick(cfg: TrainConfig, pick: Plan, record: dict) -> TrainConfig:
    """The TrainConfig of the pick: its axes, schedule, micro-batches, recomputation (the user's selective kept) and
    sequence parallelism (on with tp, as the planner prices it), and its DeepSpeed JSON under ZeRO auto."""
    c = pick.candidate
    recompute = "full" if c.recompute else ("none" if cfg.recompute == "full" else cfg.recompute)
    return dataclasses.replace(
        cfg, tp=c.tp, pp=c.pp, cp=c.cp, ep=c.ep, schedule=c.schedule if c.pp > 1 else cfg.schedule,
        virtual_stages=c.virtual_stages if c.pp > 1 else cfg.virtual_stages, micro_batches=c.micro_batches,
        recompute=recompute, sequence_parallel=cfg.sequence_parallel or c.sequence_parallel,
        deepspeed_config=ds_config_of(cfg, pick, record["zero"]), layout_choice=record)


def ds_config_of(cfg: TrainConfig, pick: Plan, zero: str):
    """--deepspeed_config auto: the plan's JSON (None under ZeRO-0: DDP runs it); a JSON with zero_optimization
    "auto": that section from the plan, the rest as written."""
    c = pick.candidate
    if zero in ("none", "fixed"):
        return cfg.deepspeed_config
    ds = deepspeed_config(c.zero_stage, c.offload_optimizer, c.offload_params, c.micro_batch_size, c.micro_batches,
                          c.dp, c.cfg, c.precision if c.precision == "fp32" else "bf16-mixed", cfg.grad_clip)
    if zero == "auto":
        return ds if c.zero_stage else None
    from trainer3d.zero.config import load_ds_json

    return dict(load_ds_json(cfg.deepspeed_config)[0], zero_optimization=ds["zero_optimization"])


def resolve_auto(cfg: TrainConfig, mcfg, machine: Machine) -> TrainConfig:
    """--layout auto: the TrainConfig with the planner's pick for `machine` applied (a pure function of its inputs)."""
    pick, _, record = choose(cfg, mcfg, machine)
    return apply_pick(cfg, pick, record)


def agree_on_pick(record: dict, group) -> None:
    """Collective, once at launch: every rank planned alike, else every rank raises the same sentence. Ranks that
    read different machines (mixed nodes) would build different process groups and hang in them."""
    m = record["machine"]
    mine = (record["pick"], round(m["memory_gib"], 3), m["ranks_per_node"], m["name"], m.get("calibrated") or "none")
    seen = all_gather_object(mine, group)
    odd = next((r for r, p in enumerate(seen) if p != seen[0]), None)
    if odd is not None:
        (a, ma, na, da, ca), (b, mb, nb, db, cb) = seen[0], seen[odd]
        raise ConfigError(f"--layout auto planned {a} on rank 0 ({ma} GiB, {na} ranks a node, {da}, calibrated {ca}) "
                          f"but {b} on rank {odd} ({mb} GiB, {nb} ranks a node, {db}, calibrated {cb}): the nodes "
                          "differ; pass --device-memory-gib (and launch as many ranks on every node), and give every "
                          "node the same calibration (a shared $TRAINER3D_CACHE), so that every rank plans alike.")


def choice_lines(record: dict) -> list[str]:
    """What rank 0 prints before training: the pick, why, the runner-up, and what the estimates mean here."""
    m, est = record["machine"], record["estimate"]
    nominal = " (nominal CPU constants: the estimates rank layouts, they are no CPU's seconds)" \
        if m["device"] == "cpu" else ""
    if m.get("calibrated"):
        nominal = f" (calibrated on this machine {m['calibrated']}: python -m trainer3d.plan --calibrate)"
    lines = [f"--layout auto on {m['nodes']} node(s) × {m['ranks_per_node']} {m['name'] or m['device']} ranks, "
             f"{m['memory_gib']:.1f} GiB each{nominal}: {record['pick']} (est. {est['step_s'] * 1e3:.3g} ms/step, "
             f"{est['memory_gib']:.2f} GiB/rank)", f"  why: {record['why']}"]
    if record["runner_up"]:
        ru = record["runner_up_estimate"]
        lines.append(f"  runner-up: {record['runner_up']} (est. {ru['step_s'] * 1e3:.3g} ms/step, "
                     f"{ru['memory_gib']:.2f} GiB/rank)")
    if record["constraints"]:
        lines.append("  kept as given: " + ", ".join(f"--{k.replace('_', '-')} {v}"
                                                     for k, v in record["constraints"].items()))
    return lines
