"""What the planner prints and writes: the table of plans, why each wins, the trainer's flags and launch command
for a plan, and the DeepSpeed JSON it proposes.
"""

from __future__ import annotations

from trainer3d.config import SIZE_FLAGS
from trainer3d.config.fields import option_name
from trainer3d.models import MODEL_PRESETS
from trainer3d.plan.candidate import describe, gib
from trainer3d.plan.cluster import Cluster
from trainer3d.plan.search import Plan
from trainer3d.plan.step_time import flops_per_token
from trainer3d.zero.config import auto_buckets

DS_CONFIG_PATH = "plan_ds_config.json"  # what a ZeRO plan's command reads unless --write-ds-config names a path


# ---- DeepSpeed JSON ----------------------------------------------------------------------------------------
def zero_buckets(cfg) -> dict:
    """DeepSpeed's "auto" bucket sizes (zero.config.auto_buckets) plus a bound on ZeRO-3's live parameters; the memory
    model charges the reduce bucket and ZeRO-3's working set accordingly."""
    live = 2 * cfg.block_params()  # two blocks' parameters
    return {
        **auto_buckets(cfg.n_embd),
        # DeepSpeed's defaults (1e9) keep every gathered parameter of a small model alive through the step;
        # bounded to two blocks, ZeRO-3's working set is what the memory model charges
        "stage3_max_live_parameters": live,
        "stage3_max_reuse_distance": live,
    }


def deepspeed_config(zero_stage: int, offload_optimizer: bool, offload_params: bool, micro_batch_size: int,
                     micro_batches: int, dp: int, cfg, precision: str = "bf16-mixed", grad_clip: float = 1.0) -> dict:
    """The DeepSpeed JSON for a plan, in the form trainer3d's ZeRO path reads (--deepspeed_config): it owns the
    batch (micro × accumulation × dp), ZeRO stage, offload and precision; the optimizer section is optional (AdamW
    with the trainer's flags) and clipping is the trainer's global one."""
    z: dict = {"stage": zero_stage, "overlap_comm": False, "contiguous_gradients": True, **zero_buckets(cfg)}
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


def plan_deepspeed_config(p: Plan) -> dict:
    """The DeepSpeed JSON of a ZeRO plan (DeepSpeed's bf16, as the memory model assumes for ZeRO 1-3)."""
    c = p.candidate
    return deepspeed_config(c.zero_stage, c.offload_optimizer, c.offload_params, c.micro_batch_size,
                            c.micro_batches, c.dp, c.cfg, "bf16-mixed")


# ---- table and reasons -----------------------------------------------------------------------------------------
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
            text += f"; the next layout ({describe(runner_up.candidate)}) is {slower:.1%} slower: {dominant(diffs) or 'same costs'}"
        return text
    diffs = {k: p.times.get(k, 0.0) - best.times.get(k, 0.0) for k in set(p.times) | set(best.times)}
    text = f"{p.step_time / best.step_time - 1:+.1%} step time vs #1 ({dominant(diffs) or 'same costs'})"
    dm = best.memory - p.memory
    if dm > 0.5 * 2**30:
        text += f"; {gib(dm):.1f} GiB less memory per GPU (more headroom)"
    elif dm < -0.5 * 2**30:
        text += f"; {gib(-dm):.1f} GiB more memory"
    if p.candidate.pp == 1 and best.candidate.pp > 1:
        text += "; no pipeline (simpler, no bubble)"
    if p.candidate.zero_stage == 0 and best.candidate.zero_stage > 0:
        text += "; plain DDP (no DeepSpeed)"
    return text


def model_flops_utilization(p: Plan, C: Cluster) -> float:
    """Model FLOPs (the family's count: a mixture of experts' active ones; a recomputed forward not counted) over the
    cluster's peak for the step time."""
    c = p.candidate
    return flops_per_token(c) * c.global_batch * c.seq_len / (p.step_time * C.world * C.peak_tflops * 1e12)


def format_plans(shown: list[Plan], C: Cluster) -> str:
    """The table: layout, memory, step time, throughput, MFU and the split of the step time."""
    rows = []
    for i, p in enumerate(shown):
        c = p.candidate
        total = p.step_time
        br = " ".join(f"{k} {v / total:.0%}" for k, v in p.times.items() if v / total >= 0.005)
        tok = c.global_batch * c.seq_len
        mfu = model_flops_utilization(p, C)
        rows.append([str(i + 1), describe(c), f"{gib(p.memory):.1f}", f"{gib(p.host):.1f}" if p.host else "-",
                     f"{total:.3f}", f"{tok / total:,.0f}", f"{mfu:.1%}", br])
    header = ["#", "layout (m = micro-batches x size)", "GiB/GPU", "host GiB/GPU", "step s", "tokens/s", "MFU", "time split"]
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


# ---- launch -------------------------------------------------------------------------------------------------
def model_flags(model_name: str | None, cfg) -> list[str]:
    """The trainer's model flags: a preset's name, else the family's first preset with the sizes overridden."""
    if model_name not in MODEL_PRESETS:
        model_name = next(name for name, c in MODEL_PRESETS.items() if c.family == cfg.family)
    base = MODEL_PRESETS[model_name]
    flags = ["--model", model_name]
    for field in SIZE_FLAGS:
        if field != "n_positions" and field in base.__dataclass_fields__ and getattr(cfg, field) != getattr(base, field):
            flags += [option_name(field), str(getattr(cfg, field))]
    if cfg.vocab_size != base.vocab_size:
        flags += ["--vocab-size", str(cfg.vocab_size)]
    if cfg.n_positions != base.n_positions:
        flags += ["--n-positions", str(cfg.n_positions)]
    return flags


def train_flags(p: Plan, model_name: str | None, ds_path: str | None) -> list[str]:
    c = p.candidate
    flags = model_flags(model_name, c.cfg) + ["--tp", str(c.tp), "--pp", str(c.pp)]
    if c.cp > 1:
        flags += ["--cp", str(c.cp)]
    if c.ep > 1:
        flags += ["--ep", str(c.ep)]
    if c.pp > 1:
        flags += ["--schedule", c.schedule]
        if c.virtual_stages > 1:
            flags += ["--virtual-stages", str(c.virtual_stages)]
    flags += ["--micro-batches", str(c.micro_batches), "--global-batch", str(c.global_batch),
              "--seq-len", str(c.seq_len)]
    if c.recompute:
        flags += ["--recompute", "full"]
    if c.sequence_parallel:
        flags += ["--sequence-parallel"]
    if c.fp8:
        flags += ["--fp8", c.fp8]
    if c.zero_stage:
        flags += ["--deepspeed_config", ds_path or DS_CONFIG_PATH]
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
