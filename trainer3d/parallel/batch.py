"""How the global batch splits over dp replicas and micro-batches: the one rule for DDP and (as the default of
"auto" values) for the DeepSpeed JSON."""

from __future__ import annotations

from dataclasses import dataclass

from trainer3d.errors import LayoutError
from trainer3d.parallel.pipeline import SCHEDULES


@dataclass(frozen=True)
class BatchPlan:
    global_batch: int  # sequences per optimizer step
    micro_batches: int  # per dp rank and step (gradient accumulation / pipeline micro-batches)
    micro_batch_size: int  # sequences per micro-batch

    @property
    def local_batch(self) -> int:
        return self.micro_batches * self.micro_batch_size


def default_micro_batches(schedule: str, pp: int) -> int:
    """1 without a pipeline; pp micro-batches fill a pipeline, 2·pp one with several stages per rank."""
    if pp == 1:
        return 1
    return 2 * pp if SCHEDULES[schedule].multi_stage else pp


def global_batch_of(cfg) -> int:
    """Sequences per step from --global-batch or --global-batch-tokens."""
    if cfg.global_batch_tokens is None:
        return cfg.global_batch
    if cfg.global_batch_tokens % cfg.seq_len:
        raise LayoutError(
            f"--global-batch-tokens {cfg.global_batch_tokens} is not a multiple of --seq-len {cfg.seq_len}; "
            "make it one (e.g. 524288 tokens = 512 × 1024)."
        )
    return cfg.global_batch_tokens // cfg.seq_len


def plan_batch(cfg, dp: int, pp: int) -> BatchPlan:
    gb = global_batch_of(cfg)
    mb = cfg.micro_batches if cfg.micro_batches is not None else default_micro_batches(cfg.schedule, pp)
    if mb < 1:
        raise LayoutError(f"--micro-batches must be at least 1 (got {mb}).")
    if gb % (dp * mb):
        raise LayoutError(
            f"The global batch of {gb} sequences does not split into dp={dp} × {mb} micro-batches; "
            f"make --global-batch a multiple of {dp * mb} or change --micro-batches."
        )
    return BatchPlan(global_batch=gb, micro_batches=mb, micro_batch_size=gb // (dp * mb))
