"""Every check of a run's configuration that needs no process group, made once, before any process group exists: a
bad flag, layout, DeepSpeed JSON or Hugging Face directory fails here with one sentence, on every rank alike. The
result, `RunSetup`, is what the rest of the run is built from (the DeepSpeed JSON resolved once, here)."""

from __future__ import annotations

from dataclasses import dataclass

from trainer3d.checkpoint.hf_init import hf_model_config
from trainer3d.config import TrainConfig
from trainer3d.dist.topology import Layout, infer_layout
from trainer3d.errors import ConfigError
from trainer3d.model import MODEL_PRESETS, GPTConfig
from trainer3d.parallel.batch import BatchPlan, plan_batch
from trainer3d.parallel.pipeline import check_pipeline
from trainer3d.parallel.tensor_parallel import check_tensor_parallel
from trainer3d.train.profiling import parse_step_range
from trainer3d.zero.config import DeepSpeedSpec, resolve_deepspeed


@dataclass(frozen=True)
class RunSetup:
    cfg: TrainConfig  # the flags, with a DeepSpeed JSON's batch, lr, clip, precision and Adam settings applied
    layout: Layout
    plan: BatchPlan
    deepspeed: DeepSpeedSpec | None  # None: DDP is the data-parallel engine
    hf_base: GPTConfig | None = None  # --init-from-hf: the Hugging Face model's shape (and vocabulary)

    def model_config(self, vocab_size: int) -> GPTConfig:
        return self.cfg.gpt_config(vocab_size, base=self.hf_base)


def validate(cfg: TrainConfig, world_size: int, vocab_size: int = 50257) -> RunSetup:
    if cfg.model not in MODEL_PRESETS:
        raise ConfigError(f"Unknown --model {cfg.model!r}; choose one of {', '.join(MODEL_PRESETS)}.")
    if cfg.precision not in ("auto", "fp32", "bf16", "fp16"):
        raise ConfigError(f"--precision must be auto, fp32, bf16 or fp16 (got {cfg.precision!r}).")
    layout = infer_layout(world_size, cfg.tp, cfg.pp)
    hf_base = hf_model_config(cfg.init_from_hf) if cfg.init_from_hf else None
    mcfg = cfg.gpt_config(vocab_size, base=hf_base)
    if cfg.seq_len > mcfg.n_positions:
        raise ConfigError(
            f"--seq-len {cfg.seq_len} exceeds the model's context of {mcfg.n_positions} positions; "
            f"use --seq-len {mcfg.n_positions} or less."
        )
    if mcfg.n_embd % mcfg.n_head:
        raise ConfigError(f"--n-embd {mcfg.n_embd} must be a multiple of --n-head {mcfg.n_head}.")
    check_tensor_parallel(mcfg, layout.tp)
    deepspeed = None
    if cfg.deepspeed_config is not None:  # the JSON owns the batch; also checks the JSON itself
        deepspeed = resolve_deepspeed(cfg, layout, mcfg.n_embd)
        cfg, plan = deepspeed.cfg, deepspeed.plan
    else:
        plan = plan_batch(cfg, layout.dp, layout.pp)
    check_pipeline(mcfg, layout.pp, cfg.schedule, cfg.virtual_stages, plan.micro_batches)
    if cfg.max_steps < 1:
        raise ConfigError("--max-steps must be at least 1.")
    if cfg.save_every < 0 or cfg.keep_last < 0:
        raise ConfigError("--save-every and --keep-last must be 0 (off) or a positive number.")
    if cfg.dist_timeout <= 0:
        raise ConfigError(f"--dist-timeout must be a positive number of seconds (got {cfg.dist_timeout}).")
    if cfg.profile_steps is not None:
        parse_step_range(cfg.profile_steps, cfg.max_steps)
    return RunSetup(cfg=cfg, layout=layout, plan=plan, deepspeed=deepspeed, hf_base=hf_base)
