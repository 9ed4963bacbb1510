"""Every check of a run's configuration that needs no process group, made once, before any process group exists: a
bad flag, layout, DeepSpeed JSON or Hugging Face directory fails here with one sentence, on every rank alike. The
result, `RunSetup`, is what the rest of the run is built from (the DeepSpeed JSON resolved once, here)."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer3d.checkpoint.format import checkpoints_root, resolve_checkpoint
from trainer3d.checkpoint.hf_init import hf_model_config
from trainer3d.checkpoint.peft import read_spec
from trainer3d.config import PRECISIONS, RECOMPUTE_MODES, SIZE_FLAGS, TrainConfig
from trainer3d.config.fields import option_name
from trainer3d.data.hellaswag import Example, read_examples
from trainer3d.data.chat_formats import FORMATS as CHAT_FORMATS
from trainer3d.data.mixture import read_mixture
from trainer3d.data.shards import looks_prepared
from trainer3d.data.sources import DataConfig, check_data_path, looks_like_path
from trainer3d.distributed.topology import LaunchEnv, Layout, Topology, device_type, infer_layout
from trainer3d.errors import ConfigError, LayoutError
from trainer3d.rundir import CHECKPOINTS, earlier_run
from trainer3d.data.tokenizer import has_tokenizer_files
from trainer3d.models import MODEL_PRESETS, family_of
from trainer3d.parallel.batch import BatchPlan, plan_batch
from trainer3d.parallel.compile import check_compiler
from trainer3d.parallel.context_parallel import check_context_parallel
from trainer3d.parallel.expert_parallel import check_expert_parallel
from trainer3d.parallel.fp8 import check_fp8
from trainer3d.parallel.lora import LoRASpec, check_lora
from trainer3d.parallel.pipeline import SCHEDULES, check_pipeline, last_stage_pp_rank
from trainer3d.parallel.sequence_parallel import check_sequence_parallel
from trainer3d.plan import calibrate
from trainer3d.plan.auto import Machine, read_machine, resolve_auto
from trainer3d.train.dpo import check_dpo, check_dpo_batch, check_reference
from trainer3d.train.metrics import device_peak_tflops
from trainer3d.train.profiling import parse_step_range
from trainer3d.zero.config import DeepSpeedSpec, resolve_deepspeed


@dataclass(frozen=True)
class RunSetup:
    cfg: TrainConfig  # the flags, with a DeepSpeed JSON's batch, lr, clip, precision and Adam settings applied
    layout: Layout
    plan: BatchPlan
    deepspeed: DeepSpeedSpec | None  # None: DDP is the data-parallel engine
    # the config of weights the run starts from, which sets the model and its vocabulary (--init-from-hf: the Hugging
    # Face model's; trainer3d.evaluate: the checkpoint's); None: the --model preset and the tokenizer's vocabulary
    base_model: object | None = None
    hellaswag: tuple[Example, ...] | None = None  # --eval-hellaswag: its examples, every line checked

    def topology(self, ranks: list[int] | None = None) -> Topology:
        """This run's process groups (collective: every rank of the world calls it), with the last stage where the
        schedule puts it. `ranks`: the global ranks the grid lives on (tests run several grids in one world)."""
        return Topology(self.layout, last_stage_pp_rank=last_stage_pp_rank(self.cfg.schedule, self.layout.pp),
                        ranks=ranks)

    def model_config(self, vocab_size: int):
        """The model's config, given the tokenizer's vocabulary size (which a base model's vocabulary must cover)."""
        mcfg = self.cfg.model_config(vocab_size, base=self.base_model)
        if vocab_size > mcfg.vocab_size:
            raise ConfigError(
                f"The tokenizer has {vocab_size} tokens but the model's vocabulary is {mcfg.vocab_size}; pass the "
                "tokenizer the weights were trained with (--tokenizer), or a --vocab-size of at least "
                f"{vocab_size}.")
        return mcfg


def check_combinations(cfg: TrainConfig) -> None:
    """Flags that each make sense but not together."""
    if cfg.min_lr is not None and cfg.min_lr > cfg.lr:
        raise ConfigError(f"--min-lr {cfg.min_lr} is above --lr {cfg.lr}; the cosine decays down to it: lower --min-lr.")
    typed = cfg.explicit_flags or ()
    if "global_batch" in typed and "global_batch_tokens" in typed:
        raise ConfigError("--global-batch and --global-batch-tokens both set the batch; pass only one of them.")
    if cfg.deepspeed_config is not None and cfg.on_nonfinite == "skip":
        raise ConfigError("--on-nonfinite skip cannot be kept under a DeepSpeed config (each ZeRO optimizer judges "
                          "overflow from its own partition); drop it: a non-finite step then stops the run with the "
                          "last finite step's checkpoints, to resume from.")
    if cfg.data_mixture and cfg.data:
        raise ConfigError("--data and --data-mixture both name the training data; pass only one of them (a mixture's "
                          "file lists its sources).")
    if cfg.data_mixture and cfg.val_data:
        raise ConfigError("--val-data replaces one corpus's held-out tail; a mixture's sources each hold out their own "
                          "(--val-fraction): drop --val-data.")
    if cfg.data_mixture and cfg.data_config:
        raise ConfigError("--data-config names one dataset's config; with --data-mixture give the source its own "
                          "\"data_config\" in the file.")
    if cfg.layout not in ("manual", "auto"):
        raise ConfigError(f"--layout must be manual or auto (got {cfg.layout!r}).")
    if cfg.layout != "auto" and (cfg.device_memory_gib is not None or str(cfg.deepspeed_config).lower() == "auto"):
        raise ConfigError("--device-memory-gib and --deepspeed_config auto feed the layout planner; add --layout auto "
                          "or drop them.")
    if "epochs" in typed and "max_steps" in typed:
        raise ConfigError("--epochs and --max-steps both say how long to train; pass only one of them.")
    if cfg.val_fraction == 0 and not cfg.val_data and cfg.eval_every:
        raise ConfigError("--val-fraction 0 holds nothing out to validate on; pass --eval-every 0 too (or --val-data "
                          "PATH for validation rows from elsewhere).")
    if "compile_backend" in typed and not cfg.compile:
        raise ConfigError(f"--compile-backend {cfg.compile_backend} is the backend of --compile; add --compile.")
    if cfg.hellaswag_examples is not None and not cfg.eval_hellaswag:
        raise ConfigError("--hellaswag-examples needs --eval-hellaswag PATH, the file to take them from.")
    if cfg.schedule in SCHEDULES and SCHEDULES[cfg.schedule].multi_stage and not SCHEDULES[cfg.schedule].v_shape \
            and cfg.virtual_stages == 1:
        raise ConfigError(
            f"--schedule {cfg.schedule} with --virtual-stages 1 is plain 1F1B with extra bookkeeping; pass "
            "--virtual-stages 2 (or more), or use --schedule 1f1b."
        )


def check_paths(cfg: TrainConfig) -> None:
    """Paths must exist (inputs) or be creatable and writable (--out-dir), so a run never fails after hours."""
    out = Path(cfg.out_dir).expanduser().absolute()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out-dir {cfg.out_dir} is a file; pass a directory (it is created if missing).")
    existing = out
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--out-dir {cfg.out_dir} cannot be written ({existing} is not writable); pick another path.")
    check_data_path(cfg.data)  # --init-from-hf is checked by hf_model_config, in validate
    check_data_path(cfg.val_data)
    if cfg.chat_template and not Path(cfg.chat_template).expanduser().is_file():
        raise ConfigError(f"--chat-template {cfg.chat_template} does not exist; pass a jinja file.")
    if cfg.data_mixture:
        read_mixture(cfg.data_mixture, cfg.text_field)  # the file and every source in it
    if cfg.tokenizer and looks_like_path(cfg.tokenizer) and not Path(cfg.tokenizer).expanduser().exists():
        raise ConfigError(f"--tokenizer {cfg.tokenizer} does not exist; pass an existing path or a Hugging Face name.")
    if cfg.resume not in (None, "latest"):
        resolve_checkpoint(cfg.resume)  # raises one sentence if the path holds no complete checkpoint


def check_out_dir(cfg: TrainConfig) -> None:
    """A training run never overwrites or mixes with an earlier run in its --out-dir: it continues it (--resume),
    replaces it (--overwrite, HF Trainer's convention) or is refused. --resume with no checkpoint to resume from starts
    fresh (a requeued job's first start) only where no earlier run would be overwritten. Checked by the training entry
    point beside `validate` (programs that build a trainer without writing a run, such as the tests, skip it)."""
    if cfg.overwrite and cfg.resume is not None:
        raise ConfigError("--overwrite deletes the run that --resume would continue; pass only one of them.")
    found = earlier_run(cfg.out_dir)
    if not found or cfg.overwrite:
        return
    if cfg.resume is None:
        raise ConfigError(f"--out-dir {cfg.out_dir} holds an earlier run ({', '.join(found)}); pass --resume to "
                          "continue it, --overwrite to start over in its place, or another --out-dir.")
    if cfg.resume == "latest" and CHECKPOINTS not in found:
        raise ConfigError(f"--resume finds no checkpoint in {checkpoints_root(cfg.out_dir)}, but --out-dir holds an "
                          "earlier run's metrics.jsonl; pass --overwrite to start over in its place, or another "
                          "--out-dir.")


MOE_FLAGS = ("moe_aux_loss_coef", "moe_z_loss_coef", "moe_bias_update_rate", "moe_capacity_factor")


def check_moe_flags(cfg: TrainConfig, mcfg, layout) -> None:
    """The mixture-of-experts flags make sense only for a model with experts, loss-free balancing's bias only on
    sigmoid router scores, and transformers' pooled loss only where one rank holds every layer of its tokens whole."""
    given = [f for f in MOE_FLAGS if getattr(cfg, f)]
    if mcfg.moe is None:
        if given:
            raise ConfigError(f"{option_name(given[0])} applies to a mixture of experts, and this model has none; drop it.")
        return
    if cfg.moe_bias_update_rate and mcfg.moe.score != "sigmoid":
        raise ConfigError(f"--moe-bias-update-rate trains a selection bias for sigmoid router scores (DeepSeek-V3's "
                          f"loss-free balancing), and this model's router scores are {mcfg.moe.score} (Megatron-core "
                          "refuses the bias there too, and its Hugging Face format has no place for it); drop it, or "
                          "balance with --moe-aux-loss-coef.")
    if cfg.moe_aux_loss == "hf" and cfg.moe_aux_loss_coef and (layout.pp > 1 or layout.tp > 1 or layout.cp > 1
                                                              or cfg.recompute == "full"):
        raise ConfigError("--moe-aux-loss hf pools every layer of a micro-batch as transformers does, which needs one "
                          "pipeline stage, no tp or cp split and no full recomputation; use --moe-aux-loss sequence "
                          "(the same at every layout).")


def check_mtp(cfg: TrainConfig, mcfg, layout) -> None:
    """Multi-token prediction needs a model with MTP modules (DeepSeek-V3's family; --mtp-loss-coef 0 builds none),
    and not transformers' pooled balance loss (its model has no MTP modules)."""
    depth = getattr(mcfg, "mtp_layers", None)
    if not depth:
        if cfg.mtp_loss_coef:
            which = (f"the {mcfg.family} family has none" if depth is None else
                     "this model has none (--mtp-layers 0, or Hugging Face weights without them)")
            raise ConfigError(f"--mtp-loss-coef {cfg.mtp_loss_coef} weighs the loss of multi-token prediction modules, "
                              f"and {which}; drop it.")
        return
    if cfg.moe_aux_loss == "hf" and cfg.moe_aux_loss_coef:
        raise ConfigError("--moe-aux-loss hf pools the layers of transformers' model, which has no multi-token "
                          "prediction modules; use --moe-aux-loss sequence, or pass --mtp-loss-coef 0.")


def check_dsa(cfg: TrainConfig, mcfg, layout) -> None:
    """DeepSeek Sparse Attention's flags need a model with indexers, and its layouts: GLM-5's shared layers read the
    selection of an earlier layer in the same forward (no pipeline cut between them); the warm-up's frozen parameters
    are built for DDP."""
    if not getattr(mcfg, "sparse", False):
        given = [f for f in ("dsa_stage", "dsa_loss_coef") if cfg.given(f)]
        if given:
            raise ConfigError(f"{option_name(given[0])} applies to DeepSeek Sparse Attention (a DeepSeek-V3.2 or "
                              "GLM-5 model), and this model has no indexer; drop it.")
        return
    if any(mcfg.index_shared) and layout.pp > 1:
        raise LayoutError("This model's shared indexer layers reuse an earlier layer's selection within one forward, "
                          "which is not built across pipeline stages (--pp > 1); drop it.")
    if cfg.dsa_stage == "warmup" and cfg.deepspeed_config is not None:
        raise ConfigError("--dsa-stage warmup freezes all but the indexers, which is built for DDP, not DeepSpeed; "
                          "drop --deepspeed_config for the warm-up (it trains a few parameters).")
    if cfg.dsa_stage == "warmup" and not cfg.dsa_loss_coef:
        raise ConfigError("--dsa-stage warmup trains the indexers by their loss alone, and --dsa-loss-coef 0 leaves "
                          "nothing to train; give it a positive weight.")


LORA_FLAGS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "lora_rslora")


def resolve_lora(cfg: TrainConfig, mcfg) -> TrainConfig:
    """LoRA's flags: --lora-from's adapter sets rank, α, dropout, targets and scaling (a flag given otherwise is
    refused) over the --init-from-hf base it was trained on; the targets and rank must fit the model."""
    given = [f for f in LORA_FLAGS if cfg.given(f)]
    if cfg.lora_from:
        if not cfg.init_from_hf:
            raise ConfigError("--lora-from continues an adapter over the base it was trained on; give that base with "
                              "--init-from-hf.")
        spec = read_spec(cfg.lora_from, mcfg)
        saved = dict(lora_rank=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                     lora_targets=",".join(spec.targets), lora_rslora=spec.rslora)
        clash = [f for f in given if getattr(cfg, f) != saved[f]]
        if clash:
            raise ConfigError(f"{option_name(clash[0])} {getattr(cfg, clash[0])} differs from --lora-from's "
                              f"{saved[clash[0]]}; drop it (the adapter's settings are the run's).")
        cfg = dataclasses.replace(cfg, **saved)
    elif not cfg.lora_rank:
        if given:
            raise ConfigError(f"{option_name(given[0])} sets up LoRA adapters; give their rank with --lora-rank.")
        return cfg
    if getattr(mcfg, "sparse", False) and cfg.dsa_stage == "warmup":
        raise ConfigError("--dsa-stage warmup trains the indexers alone and LoRA the adapters alone; drop one.")
    check_lora(mcfg, LoRASpec.of(cfg))
    return cfg


def check_size_flags(cfg: TrainConfig, base) -> None:
    """A size flag must name a field of the model's family (--n-kv-heads means nothing to GPT-2)."""
    fields = {f for f in base.__dataclass_fields__}
    for name in SIZE_FLAGS:
        if getattr(cfg, name) is not None and name not in fields:
            raise ConfigError(f"{option_name(name)} does not apply to the {base.family} model "
                              f"({cfg.init_from_hf or '--model ' + cfg.model}); drop it.")


def data_config(cfg: TrainConfig) -> DataConfig:
    """The run's data options, as the data layer takes them."""
    return DataConfig(data=cfg.data, data_config=cfg.data_config, split=cfg.data_split, text_field=cfg.text_field,
                      tokenizer=cfg.tokenizer, trust_remote_code=cfg.trust_remote_code, format=cfg.data_format,
                      messages_field=cfg.messages_field, train_on=cfg.train_on, train_roles=cfg.train_roles,
                      on_bad_row=cfg.on_bad_row, chat_template=cfg.chat_template, chat_template_kwargs=cfg.chat_template_kwargs,
                      overlong=cfg.overlong, truncation_mode=cfg.truncation_mode, pack=cfg.pack,
                      val_fraction=cfg.val_fraction, val_data=cfg.val_data)


CHAT_ONLY = {"train_on": "assistant", "train_roles": None, "on_bad_row": "drop", "overlong": "truncate",
             "messages_field": "messages", "pack": True, "chat_template": None, "chat_template_kwargs": None}


def check_chat(cfg: TrainConfig) -> TrainConfig:
    """Chat data needs a fast tokenizer with a chat template, mask options that make sense and a corpus of
    conversations (checked here, before any process group); packed conversations are masked apart and their positions
    restarted, so that packing changes nothing a conversation sees (the flags --document-mask and
    --reset-position-ids, set here)."""
    sources = read_mixture(cfg.data_mixture, cfg.text_field) if cfg.data_mixture else []
    mixed_chat = any(s.format in CHAT_FORMATS for s in sources)
    if cfg.truncation_mode != "keep_start" and cfg.data_format != "preference":
        raise ConfigError("--truncation-mode applies to --data-format preference pairs; drop it.")
    if cfg.data_format not in CHAT_FORMATS and not mixed_chat:
        pair_flags = ("on_bad_row", "overlong", "chat_template") if cfg.data_format == "preference" else ()
        given = [k for k, v in CHAT_ONLY.items() if getattr(cfg, k) != v and k not in pair_flags]
        if given:
            raise ConfigError(f"{option_name(given[0])} applies to chat data; add --data-format chat or drop it.")
        return cfg
    from trainer3d.data.sft import chat_tokenizer, mask_rule

    if not mixed_chat and (cfg.data is None or looks_prepared(cfg.data)):
        raise ConfigError("--data-format chat reads conversations from a jsonl/json/parquet file, a folder, a "
                          "save_to_disk directory or a Hugging Face dataset; pass one with --data.")
    data = data_config(cfg)
    for source in sources or [None]:
        mask_rule(source.data_config_of(data) if source else data)
    chat_tokenizer(data)
    return dataclasses.replace(cfg, document_mask=cfg.document_mask or cfg.pack,
                               reset_position_ids=cfg.reset_position_ids or cfg.pack)


def with_epochs(setup: RunSetup, steps_per_epoch: int) -> RunSetup:
    """--epochs N: the setup with max_steps = ceil(N passes over the training rows), once the rows are known (a pass
    is the loader's epoch: whole global batches of a shuffle)."""
    if not setup.cfg.epochs:
        return setup
    steps = max(1, math.ceil(setup.cfg.epochs * steps_per_epoch - 1e-9))
    return dataclasses.replace(setup, cfg=dataclasses.replace(setup.cfg, max_steps=steps))


def auto_machine(cfg: TrainConfig, world_size: int) -> Machine:
    """--layout auto's view of this machine: launcher variables, the device's total memory and peak (alike on every
    rank of a homogeneous job), or --device-memory-gib and --peak-tflops; the constants of `python -m trainer3d.plan
    --calibrate` where this kind of machine has been calibrated (plan/calibrate.py)."""
    env = LaunchEnv.from_environ()
    dev = device_type()
    peak = device_peak_tflops(torch.device(dev, 0) if dev == "cuda" else torch.device("cpu"),
                              cfg.resolved_precision(dev), cfg.peak_tflops)
    machine = read_machine(world_size, env.local_rank, os.environ, cfg.device_memory_gib, peak)
    calib = calibrate.load(torch.device(dev), machine.ranks_per_node, cfg.resolved_precision(dev))
    return dataclasses.replace(machine, measured=calibrate.constants(calib), calibrated=calib.date) if calib else machine


def validate(cfg: TrainConfig, world_size: int, vocab_size: int = 50257, base_model=None,
             machine: Machine | None = None) -> RunSetup:
    """Every check of `cfg` at `world_size` processes, in the order a user meets them: the flags alone, the weights
    and data they name, the model, the layout (--layout auto resolved here, for `machine`, default this process's:
    every rank picks alike and every check below sees the pick), the batch, and the rest of the run. `base_model`: the
    config of weights the run evaluates (trainer3d.evaluate); --init-from-hf's is read here."""
    check_flags(cfg, world_size)
    cfg, base_model = resolve_weights(cfg, base_model)
    cfg = check_chat(check_dpo(cfg))
    check_eos_token(cfg)
    mcfg = resolve_model(cfg, vocab_size, base_model)
    cfg = resolve_lora(cfg, mcfg)
    if cfg.layout == "auto":
        cfg = resolve_auto(cfg, mcfg, machine or auto_machine(cfg, world_size))
    layout = check_layout(cfg, mcfg, world_size)
    cfg, plan, deepspeed = resolve_batch(cfg, mcfg, layout)
    check_run(cfg, mcfg, layout, plan)
    hellaswag = tuple(read_examples(cfg.eval_hellaswag, cfg.hellaswag_examples)) if cfg.eval_hellaswag else None
    return RunSetup(cfg=cfg, layout=layout, plan=plan, deepspeed=deepspeed, base_model=base_model, hellaswag=hellaswag)


def check_flags(cfg: TrainConfig, world_size: int) -> None:
    """What the flags say on their own: each section's numbers, the combinations, the paths, the names, and a layout
    that cannot be (under --layout auto: the axes given, ep once dp is known)."""
    cfg.check()
    check_combinations(cfg)
    check_paths(cfg)
    if cfg.model not in MODEL_PRESETS:
        raise ConfigError(f"Unknown --model {cfg.model!r}; choose one of {', '.join(MODEL_PRESETS)}.")
    for name, value, choices in (("precision", cfg.precision, PRECISIONS), ("recompute", cfg.recompute, RECOMPUTE_MODES)):
        if value not in choices:
            raise ConfigError(f"{option_name(name)} must be one of {', '.join(choices)} (got {value!r}).")
    infer_layout(world_size, cfg.tp, cfg.pp, cfg.cp, cfg.ep if cfg.layout != "auto" else 1)


def resolve_weights(cfg: TrainConfig, base_model):
    """--init-from-hf: its config (the model's) and, where --tokenizer is not given, its own tokenizer."""
    if cfg.init_from_hf:
        base_model = hf_model_config(cfg.init_from_hf)
        if cfg.tokenizer is None and has_tokenizer_files(cfg.init_from_hf):  # the weights' own tokenizer
            cfg = dataclasses.replace(cfg, tokenizer=cfg.init_from_hf)
    return cfg, base_model


def check_eos_token(cfg: TrainConfig) -> None:
    """--eos-token: the reply's end the export and sample will stop at, one token of the vocabulary."""
    if cfg.eos_token is not None:
        from trainer3d.data.tokenizer import load_tokenizer
        from trainer3d.data.turn_end import end_of_turn_ids

        end_of_turn_ids(load_tokenizer(cfg.tokenizer, cfg.trust_remote_code), cfg.eos_token)


def resolve_model(cfg: TrainConfig, vocab_size: int, base_model):
    """The model's config with the size flags applied (each one the family has), checked against --ref-model and
    --seq-len."""
    check_size_flags(cfg, base_model or MODEL_PRESETS[cfg.model])
    mcfg = cfg.model_config(vocab_size, base=base_model)
    check_reference(cfg, mcfg, vocab_size)
    if cfg.seq_len > mcfg.n_positions:
        raise ConfigError(
            f"--seq-len {cfg.seq_len} exceeds the model's context of {mcfg.n_positions} positions; "
            f"use --seq-len {mcfg.n_positions} or less."
        )
    return mcfg


def check_layout(cfg: TrainConfig, mcfg, world_size: int) -> Layout:
    """The layout and what the model asks of it: the family's tp rule, experts over ep, MoE and MTP flags, cp and
    sequence parallelism."""
    layout = infer_layout(world_size, cfg.tp, cfg.pp, cfg.cp, cfg.ep)
    family = family_of(mcfg)
    family.check(mcfg, layout.tp)
    if layout.cp > 1 and family.check_cp is not None:
        family.check_cp(mcfg, layout.tp, layout.cp)
    problem = check_expert_parallel(mcfg, layout.ep, layout.tp, cfg.seq_len, layout.cp)
    if problem is not None:
        raise LayoutError(problem)
    check_moe_flags(cfg, mcfg, layout)
    check_mtp(cfg, mcfg, layout)
    check_dsa(cfg, mcfg, layout)
    check_context_parallel(layout.cp, cfg.seq_len)
    if cfg.sequence_parallel:
        check_sequence_parallel(layout.tp, cfg.seq_len, layout.cp)
    return layout


def resolve_batch(cfg: TrainConfig, mcfg, layout: Layout):
    """(cfg, the batch plan, the DeepSpeed spec or None): a DeepSpeed JSON owns the batch (and settles the flags it
    sets; the JSON itself is checked here), else the flags split it."""
    if cfg.deepspeed_config is None:
        return cfg, plan_batch(cfg, layout.dp, layout.pp), None
    deepspeed = resolve_deepspeed(cfg, layout, mcfg.n_embd)
    if layout.ep > 1 and deepspeed.zero_stage == 0:
        raise ConfigError(f"--ep {layout.ep} under ZeRO stage 0 is not built (it partitions nothing; the experts "
                          "would need a reduction of their own): run without the DeepSpeed config (DDP) or at "
                          "ZeRO stage 1-3.")
    return deepspeed.cfg, deepspeed.plan, deepspeed


def check_run(cfg: TrainConfig, mcfg, layout: Layout, plan: BatchPlan) -> None:
    """The rest, once the batch is planned: the pipeline's schedule, DPO's pairs, the profiler's steps, and what
    --compile and --fp8 need of this machine."""
    check_pipeline(mcfg, layout.pp, cfg.schedule, cfg.virtual_stages, plan.micro_batches, cfg.sequence_parallel)
    if cfg.objective == "dpo":
        check_dpo_batch(plan, layout, cfg.dpo_padding_free)
    if cfg.profile_steps is not None:
        parse_step_range(cfg.profile_steps, cfg.max_steps)
    if cfg.compiled_backend == "inductor":  # the other backends build no kernel
        check_compiler(device_type())
    if cfg.fp8 is not None:
        check_fp8(cfg.fp8, cfg.precision, device_type())
