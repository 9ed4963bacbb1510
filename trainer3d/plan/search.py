"""The search: enumerate every candidate trainer3d can run on a cluster, refuse what cannot run or does not fit
(each refusal counted under its reason), and rank the rest by estimated step time.

A mixture of experts adds expert parallelism: ep over the divisors of dp×cp that divide the experts (1 included;
parallel/expert_parallel.check_expert_parallel states the rule), each with DDP or ZeRO 1-3 (ZeRO partitions the
experts' state over edp, the rest over dp×cp).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from trainer3d.errors import ConfigError, LayoutError
from trainer3d.models import family_of
from trainer3d.parallel.expert_parallel import check_expert_parallel
from trainer3d.parallel.fp8 import RECIPES as FP8_RECIPES
from trainer3d.parallel.lora import LoRASpec
from trainer3d.parallel.pipeline import SCHEDULES, pipeline_problem
from trainer3d.parallel.sequence_parallel import sequence_split_problem
from trainer3d.plan.candidate import Candidate, describe, gib
from trainer3d.plan.cluster import Cluster
from trainer3d.plan.memory import MemoryEstimate, estimate_memory
from trainer3d.plan.step_time import step_times


@dataclass
class Plan:
    """A candidate with its estimates."""

    candidate: Candidate
    memory: float  # peak bytes per GPU (the worst pipeline rank)
    host: float  # offloaded bytes per GPU
    times: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def step_time(self) -> float:
        return sum(self.times.values())

    def key(self) -> tuple:
        c = self.candidate
        return (c.dp, c.tp, c.pp, c.cp, c.ep, c.schedule, c.virtual_stages, c.zero_stage, c.offload_optimizer,
                c.recompute)


@dataclass
class Search:
    plans: list[Plan]
    refused: dict[str, int]
    examples: dict[str, str]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def representative_ranks(pp: int) -> list[int]:
    """The first, second, middle, second-to-last and last pipeline ranks: the ranks where embedding, head, buffers
    and warm-up differ."""
    return sorted({0, 1 if pp > 1 else 0, pp // 2, max(pp - 2, 0), pp - 1})


def worst_rank_memory(cand: Candidate) -> tuple[int, MemoryEstimate]:
    """The pipeline rank with the highest device peak, and its estimate."""
    return max(((r, estimate_memory(cand, r)) for r in representative_ranks(cand.pp)), key=lambda re: re[1].peak)


def memory_per_gpu(cand: Candidate) -> tuple[float, float]:
    """(device peak, offloaded bytes) of the worst representative pipeline ranks."""
    ests = [estimate_memory(cand, r) for r in representative_ranks(cand.pp)]
    return max(e.peak for e in ests), max(e.offloaded for e in ests)


def default_cp_sizes(seq_len: int) -> tuple[int, ...]:
    """Context-parallel sizes worth trying: powers of two that leave each rank at least 4096 tokens of a sequence
    (shorter chunks spend more on gathering keys and values than they save), 1 included."""
    sizes, cp = [1], 2
    while seq_len % (2 * cp) == 0 and seq_len // cp >= 4096:
        sizes.append(cp)
        cp *= 2
    return tuple(sizes)


class Refusals:
    """Candidates refused, counted under their reason, with one example each."""

    def __init__(self):
        self.counts: dict[str, int] = {}
        self.examples: dict[str, str] = {}

    def __call__(self, reason: str, example: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        self.examples.setdefault(reason, example)


def cp_problem(cfg, tp: int, cp: int) -> str | None:
    """The family's reason it cannot split a sequence over cp at this tp (ModelFamily.check_cp), or None."""
    check = family_of(cfg).check_cp
    if check is None:
        return None
    try:
        check(cfg, tp, cp)
    except LayoutError as e:
        return str(e).split(";")[0]
    return None


def enumerate_plans(model, C: Cluster, global_batch: int, seq_len: int, *, schedules=None,
                    zero_stages=(0, 1, 2, 3), offload: bool = True, recompute: bool = True,
                    max_micro_batch_size: int = 64, allow_tp_across_nodes: bool = False,
                    cp_sizes: tuple[int, ...] | None = None, fixed: dict[str, int] | None = None,
                    precision: str | None = None, fp8: str | None = None, lora=None) -> Search:
    """Every feasible plan, fastest first; offload only where the plan does not fit without it. `cp_sizes`: the
    context-parallel sizes to try (default_cp_sizes); `fixed`: tp and/or pp held at a value (a launch's explicit
    flags, plan/auto.py); `precision`: one of candidate.PRECISIONS for every plan (default: bf16 autocast for DDP,
    bf16 mixed precision under ZeRO, what a GPU run does); `fp8`: every plan with --fp8 of that recipe; `lora`: every
    plan training LoRA adapters of that LoRASpec over a frozen base."""
    refuse = Refusals()
    cfg = replace(model, n_positions=max(model.n_positions, seq_len))
    schedules = list(schedules or ["gpipe", "1f1b", "interleaved-1f1b", "zbv"])
    plans = []
    for dp, tp, cp, pp in _grids(cfg, C, global_batch, seq_len, cp_sizes, allow_tp_across_nodes, refuse, fixed or {}):
        pipelines = list(_pipelines(cfg, pp, global_batch // dp, schedules, max_micro_batch_size, refuse,
                                    f"dp{dp} tp{tp} pp{pp}"))
        for ep in expert_parallel_sizes(cfg, dp, tp, cp, seq_len, refuse):
            for s, v, m, mbs in pipelines:
                layout = dict(cfg=cfg, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, schedule=s, virtual_stages=v,
                              micro_batches=m, micro_batch_size=mbs, seq_len=seq_len)
                plans += _fitting(layout, C, zero_stages, offload, recompute, refuse, precision, fp8, lora)
    plans.sort(key=lambda p: (p.step_time, p.memory))
    return Search(plans, refuse.counts, refuse.examples)


def _grids(cfg, C: Cluster, global_batch: int, seq_len: int, cp_sizes, allow_tp_across_nodes: bool, refuse,
           fixed: dict[str, int]):
    """(dp, tp, cp, pp) of the cluster's world that the model, the batch and the sequence allow (tp, pp as `fixed`)."""
    N = C.world
    for tp in divisors(N):
        if fixed.get("tp", tp) != tp:
            continue
        try:
            family_of(cfg).check(cfg, tp)
        except LayoutError as e:
            refuse("tp does not divide the attention heads", f"tp{tp}: {str(e).split(';')[0]}")
            continue
        if tp > C.gpus_per_node and not allow_tp_across_nodes:
            refuse("tp larger than a node (its all-reduces would cross the network)", f"tp{tp}")
            continue
        for cp in cp_sizes or default_cp_sizes(seq_len):
            if (N // tp) % cp:
                continue
            if cp > 1 and cp_problem(cfg, tp, cp):
                refuse("cp does not divide the model's heads", f"cp{cp} tp{tp}: {cp_problem(cfg, tp, cp)}")
                continue
            problem = sequence_split_problem(tp, seq_len, cp) if tp > 1 else None  # plans use SP at every tp > 1
            if problem is not None:
                refuse("sequence parallelism cannot split a rank's tokens over tp", f"cp{cp} tp{tp}")
                continue
            for pp in divisors(N // (tp * cp)):
                if fixed.get("pp", pp) != pp:
                    continue
                dp = N // (tp * cp * pp)
                if global_batch % dp:
                    refuse("global batch not divisible by dp", f"dp{dp}, batch {global_batch}")
                    continue
                yield dp, tp, cp, pp


def expert_parallel_sizes(cfg, dp: int, tp: int, cp: int, seq_len: int, refuse) -> list[int]:
    """The ep sizes a grid allows: 1, and for a mixture of experts every divisor of dp×cp that the trainer's rule
    accepts (it divides the experts)."""
    if cfg.moe is None:
        return [1]
    sizes = []
    for ep in divisors(dp * cp):
        problem = check_expert_parallel(cfg, ep, tp, seq_len, cp)
        if problem is None:
            sizes.append(ep)
        else:
            refuse("ep does not divide the experts" if cfg.moe.n_experts % ep else "expert parallelism rule",
                   f"dp{dp} cp{cp} ep{ep}: {problem}")
    return sizes


def _pipelines(cfg, pp: int, local_batch: int, schedules: list[str], max_micro_batch_size: int, refuse, where: str):
    """(schedule, virtual stages, micro-batches, micro-batch size) that pipeline's rules allow for this dp rank's
    `local_batch` sequences."""
    options = [("1f1b", 1)] if pp == 1 else []
    for s in schedules if pp > 1 else ():
        info = SCHEDULES[s]
        if info.multi_stage and not info.v_shape:
            options += [(s, v) for v in (2, 4) if pp * v <= cfg.n_layer]
        else:
            options.append((s, 1))
    for s, v in options:
        for mbs in (d for d in divisors(local_batch) if d <= max_micro_batch_size):
            m = local_batch // mbs
            problem = pipeline_problem(cfg, pp, s, v, m)
            if problem is not None:
                refuse(f"pipeline rule: {problem[0]}", f"{where} {s} m{m}")
                continue
            yield s, v, m, mbs


def _fitting(layout: dict, C: Cluster, zero_stages, offload: bool, recompute: bool, refuse,
             precision: str | None = None, fp8: str | None = None, lora=None) -> list[Plan]:
    """The plans of one layout that fit, over ZeRO stages, offload and recomputation; offload only where the plan
    does not fit without it."""
    plans = []
    s, dp = layout["schedule"], layout["dp"]
    for z in zero_stages:
        if z and dp == 1:
            continue  # nothing to partition over
        if z and SCHEDULES[s].split_backward:
            refuse("ZeRO with a split-backward schedule (trainer3d/zero/ refuses it)", f"{s} ZeRO-{z}")
            continue
        offloads = [(False, False)] + ([(True, False)] if offload and z >= 1 else []) + \
            ([(True, True)] if offload and z == 3 else [])
        fits_without_offload = set()
        for (off_o, off_p), rc in ((o, r) for o in offloads for r in ((False, True) if recompute else (False,))):
            if off_o and rc in fits_without_offload:
                continue  # offloading only costs time when the plan fits without it
            prec = precision or ("bf16-autocast" if z == 0 else "bf16-mixed")
            cand = Candidate(**layout, precision=prec, zero_stage=z,
                             offload_optimizer=off_o, offload_params=off_p, recompute=rc,
                             # the same tp bytes, activations /tp: on at tp > 1
                             sequence_parallel=layout["tp"] > 1,
                             fp8=fp8, lora=lora)
            mem, host = memory_per_gpu(cand)
            if mem > C.usable_bytes:
                refuse("does not fit in GPU memory", f"{describe(cand)}: {gib(mem):.1f} GiB")
            elif host * C.gpus_per_node > C.host_memory_gib * 2**30:
                refuse("offloaded state does not fit in host memory", describe(cand))
            else:
                fits_without_offload |= set() if off_o else {rc}
                plans.append(Plan(cand, mem, host, step_times(cand, C)))
    return plans


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


def _fp8_recipe(value: str, text: str) -> str | None:
    """--evaluate's fp8=: a recipe, 1/true for rowwise (the flag's default), 0/false for none."""
    recipes = {"0": None, "false": None, "1": "rowwise", "true": "rowwise", **{r: r for r in FP8_RECIPES}}
    if value not in recipes:
        raise ConfigError(f"--evaluate: fp8={value} is none of {', '.join(recipes)} (in {text!r}).")
    return recipes[value]


def parse_layout(text: str, cfg, C: Cluster, global_batch: int, seq_len: int) -> Candidate:
    """The candidate of an --evaluate string, e.g. `tp=8,pp=16,schedule=1f1b,mbs=1,zero=0,recompute=1` (`ep=8`: the
    experts over 8 of the dp×cp ranks)."""
    keys = ("tp", "pp", "cp", "ep", "schedule", "v", "mbs", "zero", "offload", "recompute", "sp", "fp8", "lora")
    items = [item.split("=", 1) for item in text.replace(" ", "").split(",") if item]
    if any(len(kv) != 2 or kv[0] not in keys for kv in items):
        raise ConfigError(f"--evaluate takes key=value pairs from {', '.join(keys)} separated by commas "
                          f"(e.g. tp=8,pp=16,schedule=1f1b,mbs=1), not {text!r}.")
    kv = dict(items)
    try:
        tp, pp, cp, ep, mbs, z, v = (int(kv.get(k, d)) for k, d in (("tp", 1), ("pp", 1), ("cp", 1), ("ep", 1),
                                                                      ("mbs", 1), ("zero", 0), ("v", 1)))
    except ValueError:
        raise ConfigError(f"--evaluate: tp, pp, cp, ep, mbs, zero and v are whole numbers, not as in {text!r}.") from None
    if min(tp, pp, cp, mbs, v) < 1 or C.world % (tp * pp * cp):
        raise ConfigError(f"--evaluate: tp×cp×pp = {tp * cp * pp} must be positive and divide the {C.world} GPUs.")
    if seq_len % (2 * cp):
        raise ConfigError(f"--evaluate: cp={cp} needs a --seq-len divisible by 2·cp = {2 * cp}.")
    if kv.get("schedule", "1f1b") not in SCHEDULES:
        raise ConfigError(f"--evaluate: schedule={kv['schedule']} is none of {', '.join(SCHEDULES)}.")
    dp = C.world // (tp * pp * cp)
    if global_batch % (dp * mbs):
        raise ConfigError(f"--evaluate: the global batch {global_batch} does not split into dp={dp} × mbs={mbs}.")
    if ep < 1 or (dp * cp) % ep:
        raise ConfigError(f"--evaluate: ep={ep} must divide dp×cp = {dp * cp} (its ranks are carved from them).")
    problem = check_expert_parallel(cfg, ep, tp, seq_len, cp)
    if problem is not None:
        raise ConfigError(f"--evaluate: {problem}")
    off = kv.get("offload", "none")
    return Candidate(
        cfg=cfg, dp=dp, tp=tp, pp=pp, schedule=kv.get("schedule", "1f1b"), virtual_stages=v,
        micro_batches=global_batch // (dp * mbs), micro_batch_size=mbs, seq_len=seq_len,
        precision="bf16-autocast" if z == 0 else "bf16-mixed", zero_stage=z,
        offload_optimizer=off in ("opt", "all"), offload_params=off == "all", recompute=kv.get("recompute", "0") in ("1", "true"),
        sequence_parallel=tp > 1 and kv.get("sp", "1") in ("1", "true"),  # on with tp, as the search has it
        cp=cp, ep=ep, fp8=_fp8_recipe(kv.get("fp8", "0"), text),
        lora=LoRASpec(int(kv["lora"]), 2.0 * int(kv["lora"])) if int(kv.get("lora", "0")) else None,
    )


def evaluate(cand: Candidate, C: Cluster) -> Plan:
    """Estimates for one candidate, feasible or not (a note says when it does not fit)."""
    mem, host = memory_per_gpu(cand)
    p = Plan(cand, mem, host, step_times(cand, C))
    if p.memory > C.usable_bytes:
        p.notes.append(f"does NOT fit: {gib(p.memory):.1f} GiB > {gib(C.usable_bytes):.1f} GiB usable")
    return p
