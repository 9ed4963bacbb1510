"""Seconds per optimizer step, by component: a model for ranking layouts, not a promise of seconds.

compute (model FLOPs at the cluster's peak × mfu, × 4/3 with recomputation, × the busiest pipeline rank's share) +
pipeline bubble + exposed communication (analytic_comm's payloads with ring factors over the intra- or
inter-node bandwidth; dp traffic partly hidden behind the backward) + the optimizer step over the rank's partition (on
the device, or CPU Adam and PCIe when offloaded).

A mixture of experts' FLOPs are its active ones (the family's flops_per_token: the router and the k experts a token
uses). Its all-to-alls (ep) sit on the critical path (nothing overlaps them in trainer3d), each rank's payload split
between the peers in its node (intra-node bandwidth) and the others (inter-node); the experts' gradient reduction
over edp is exposed (DDP: an all-reduce after the backward; ZeRO: as dp's is). The ep and edp groups are lines of
the dp×cp line (topology.Topology): ep consecutive dp×cp ranks, edp every ep-th.
"""

from __future__ import annotations

from functools import lru_cache

from trainer3d.distributed.topology import Layout
from trainer3d.parallel.fp8 import fp8_linears
from trainer3d.parallel.pipeline import SCHEDULES, stage_cost, stage_ids
from trainer3d.parallel.lora import trained_flops_per_token
from trainer3d.plan.candidate import Candidate, balanced_ranges, n_stages, partition_params, trainable_params
from trainer3d.plan.cluster import FP8_CAST_SHARE, Cluster
from trainer3d.plan.comm import analytic_comm, ring_steps

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


@lru_cache(maxsize=None)
def pipeline_pace(cfg, pp: int, schedule: str, virtual_stages: int, seq_len: int) -> tuple[float, float]:
    """(busiest pipeline rank's cost, mean rank cost) of trainer3d's balanced split, each rank's cost the sum of its
    stages' (several under an interleaved or V-shaped schedule): the busiest rank sets the pace of a pipeline."""
    n = n_stages(pp, schedule, virtual_stages)
    ranges = balanced_ranges(cfg, n, seq_len)
    costs = [stage_cost(cfg, r, i == n - 1, seq_len) for i, r in enumerate(ranges)]
    per_rank = [sum(costs[i] for i in stage_ids(r, pp, schedule, virtual_stages)) for r in range(pp)]
    return max(per_rank), sum(per_rank) / pp


def nodes_spanned(stride: int, size: int, gpn: int) -> bool:
    """Does a group of `size` ranks spaced `stride` apart span more than one node (ranks fill nodes in order)?"""
    return size > 1 and stride * size > gpn if stride < gpn else size > 1


def group_links(cand: Candidate) -> dict[str, tuple[int, int]]:
    """(stride, size) in global rank of each group, from the trainer's rank order (topology.ORDER via Layout.stride):
    neighbours on the dp×cp line are tp apart (cp varies before dp), ep takes consecutive ones, edp every ep-th."""
    L = Layout(dp=cand.dp, tp=cand.tp, pp=cand.pp, cp=cand.cp, ep=cand.ep)
    line = L.stride("cp")
    return {"tp": (L.stride("tp"), L.tp), "cp": (line, L.cp), "dp": (line, L.dp_cp), "pp": (L.stride("pp"), L.pp),
            "ep": (line, L.ep), "edp": (line * L.ep, L.edp)}


def all_to_all_seconds(payload: float, stride: int, size: int, C: Cluster) -> float:
    """An all-to-all's time: each of the other `size - 1` ranks gets 1/size of the payload, over the intra-node
    bandwidth for the peers in this rank's node and the inter-node one for the rest (the slower link sets the time)."""
    if size <= 1:
        return 0.0
    in_node = min(size, max(1, C.gpus_per_node // stride))
    return max(payload * (in_node - 1) / size / (C.intra_node_gbps * 1e9),
               payload * (size - in_node) / size / (C.inter_node_gbps * 1e9))


def flops_per_token(cand: Candidate) -> float:
    return trained_flops_per_token(cand.cfg, cand.seq_len, cand.lora)


def step_times(cand: Candidate, C: Cluster) -> dict[str, float]:
    """Seconds per optimizer step, by component."""
    tokens = cand.global_batch * cand.seq_len
    model_flops = flops_per_token(cand) * tokens
    # full recomputation runs each block's forward again in the backward; under a split-backward schedule twice, once
    # for the input-gradient pass and once for the weight pass (measured: (1,1,2) zbv 2.4x its time without, 1F1B
    # 1.5x; docs/parallelism.md)
    recomputed = (2 if SCHEDULES[cand.schedule].split_backward else 1) if cand.recompute else 0
    hw_flops = model_flops * (1 + recomputed / 3)
    fp8_casts = 0.0
    if cand.fp8:  # those matmuls at twice the bf16 peak (H100: 1979 vs 989 TFLOP/s dense), plus torchao's casts
        weights, width = fp8_linears(cand.cfg)
        hw_flops -= 6 * weights * tokens * (1 + recomputed / 3) / 2
        fp8_casts = 2 * width * tokens * (1 + recomputed / 3) * C.fp8_cast_s * FP8_CAST_SHARE[cand.fp8]
    peak = C.peak_tflops * 1e12 * C.mfu
    slow, mean = (pipeline_pace(cand.cfg, cand.pp, cand.schedule, cand.virtual_stages, cand.seq_len)
                  if cand.pp > 1 else (1.0, 1.0))
    compute = hw_flops / cand.world / peak * (slow / mean)
    t_mb = compute / cand.micro_batches  # one micro-batch through this rank's stages, forward + backward
    out = {"compute": compute}
    if cand.fp8:  # memory-bound, spread over the ranks as the FLOPs are
        out["fp8 casts"] = fp8_casts / cand.world * (slow / mean)
    if cand.pp > 1:
        coef = BUBBLE_COEF[cand.schedule]
        coef = 1.0 / cand.virtual_stages if coef is None else coef
        out["bubble"] = (cand.pp - 1) * t_mb * coef / C.ranks_per_processor  # shared: the busy ranks use it
    worst = _comm_seconds(cand, C)
    out["tp comm"] = worst.get("tp", 0.0)  # on the critical path (Megatron-style TP)
    if cand.cp > 1:
        out["cp comm"] = worst.get("cp", 0.0)  # attention waits for its keys and values (no overlap here)
    out["pp comm"] = worst.get("pp", 0.0)  # torch's schedules wait for each receive
    out["embedding"] = worst.get("embedding", 0.0)
    out["dp comm"] = _exposed_dp(cand, worst.get("dp", 0.0), t_mb, C.overlap)
    if cand.ep > 1:
        out["ep comm"] = worst.get("ep", 0.0)  # the tokens wait for their experts (no overlap here)
        edp = worst.get("edp", 0.0)  # DDP: after the backward (parallel/ddp.py); ZeRO: in its hooks, as dp's
        out["edp comm"] = _exposed_dp(cand, edp, t_mb, C.overlap) if cand.zero_stage else edp
    shard = max(partition_params(cand, cand.stages(r)) for r in sorted({0, cand.pp - 1}))  # a rank's partition
    if cand.offload_optimizer:
        out["offload"] = shard / C.cpu_adam_params_per_s + shard * (4 + 2) / (C.pcie_gbps * 1e9)
    else:  # each rank steps what it holds under DDP, its partition (1/dp×cp) under ZeRO
        trained = max(trainable_params(cand, cand.stages(r)) for r in sorted({0, cand.pp - 1}))  # (LoRA: adapters)
        held = trained if not cand.zero_stage else shard if cand.lora is None else trained / cand.dp_cp
        out["optimizer"] = held / C.adam_params_per_s
    if cand.offload_params:
        out["offload"] = out.get("offload", 0.0) + cand.micro_batches * 2 * shard * 2 / (C.pcie_gbps * 1e9)
    return out


def _comm_seconds(cand: Candidate, C: Cluster) -> dict[str, float]:
    """Seconds on the wire per group, for the busiest pipeline rank (first or last: embedding / head); scalars left
    out."""
    links = group_links(cand)
    across = {g: nodes_spanned(stride, size, C.gpus_per_node) for g, (stride, size) in links.items()}
    across["embedding"] = across["pp"]
    worst: dict[str, float] = {}
    for r in sorted({0, cand.pp - 1}):
        per_group: dict[str, float] = {}
        for t in analytic_comm(cand, r):
            if t.group in ("world", "mp"):
                continue  # scalars
            gbps, latency = C.link(across[t.group], t.op)
            if t.op == "all_to_all":
                seconds = all_to_all_seconds(t.payload, *links[t.group], C)
            else:
                seconds = t.wire / (gbps * 1e9)
            seconds += t.calls * ring_steps(t.op, t.n) * latency
            per_group[t.group] = per_group.get(t.group, 0.0) + seconds
        for g, v in per_group.items():
            worst[g] = max(worst.get(g, 0.0), v)
    return worst


def _exposed_dp(cand: Candidate, t_dp: float, t_mb: float, ov: float) -> float:
    """The part of the dp traffic (`t_dp` seconds on the wire) that the backward (2/3 of `t_mb` per micro-batch)
    cannot hide, with `ov` the fraction of a compute window that overlaps."""
    t_bwd_mb = t_mb * 2 / 3
    if cand.zero_stage == 0:
        # DDP overlaps its all-reduce with the last micro-batch's backward; the zero-bubble schedules reduce
        # after the schedule (parallel/ddp.py all_reduce_grads), with nothing to hide behind
        return t_dp if SCHEDULES[cand.schedule].split_backward else max(0.0, t_dp - ov * t_bwd_mb)
    if cand.zero_stage in (1, 2):
        rs, ag = t_dp / 2, t_dp / 2  # reduce-scatter and all-gather carry the same bytes
        if cand.zero_stage == 2:  # a reduce-scatter every micro-batch (analytic_comm counts them all)
            return cand.micro_batches * max(0.0, rs / cand.micro_batches - ov * t_bwd_mb) + ag
        return max(0.0, rs - ov * t_bwd_mb) + ag  # reduce at the last micro-batch, all-gather after the step
    # ZeRO-3, per micro-batch: the forward all-gather hides behind the forward (prefetch), the backward
    # all-gather and the reduce-scatter behind the backward
    per_mb = t_dp / cand.micro_batches
    ag, rs = per_mb / 3, per_mb / 3
    return cand.micro_batches * (max(0.0, ag - ov * t_mb / 3) + max(0.0, ag + rs - ov * t_bwd_mb))
