"""A DeepSpeed JSON resolved against the flags and the layout, once per run and before any process group.

The JSON owns what it owns (batch sizes, accumulation, ZeRO stage, offload, precision, Adam's settings); its
"auto" values are filled from the flags and the layout, and a value that contradicts an explicitly given flag,
or cannot work, is refused with one sentence naming the fix (`resolve_deepspeed`). zero/engine.py runs the engines.

    python -m trainer3d.zero --check-config ds_configs/zero3.json --world-size 8 --tp 2 --pp 2   # resolved JSON
    python -m trainer3d.zero --build-ops     # once: DeepSpeed's JIT ops into $TORCH_EXTENSIONS_DIR
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from trainer3d.errors import ConfigError
from trainer3d.parallel.batch import BatchPlan, default_micro_batches
from trainer3d.parallel.pipeline import SCHEDULES
from trainer3d.zero.ops import aio_available, check_deepspeed_version
SUPPORTED_OPTIMIZERS = ("adam", "adamw")


# ---- the JSON: load, fill "auto", check against the flags and the layout ---------------------------------------
@dataclass
class DeepSpeedSpec:
    """A DeepSpeed JSON resolved against the flags and the layout."""

    ds_config: dict  # what deepspeed.initialize gets: concrete values, no optimizer/scheduler, no clipping
    cfg: Any  # the TrainConfig with the JSON's batch, lr, clip, precision and Adam settings applied
    plan: BatchPlan
    zero_stage: int  # 0-3 (not a pipeline stage)
    offload_optimizer: str  # "none", "cpu" or "nvme"
    offload_param: str
    adamw: bool  # decoupled weight decay (AdamW) rather than L2 (Adam with adam_w_mode false)
    eps: float
    source: str  # the file name, for messages


def load_ds_json(path_or_dict) -> tuple[dict, str]:
    if isinstance(path_or_dict, dict):
        return copy.deepcopy(path_or_dict), "<dict>"
    path = str(path_or_dict)
    if not os.path.isfile(path):
        raise ConfigError(f"--deepspeed_config {path} does not exist; pass the path of a DeepSpeed JSON (see ds_configs/).")
    try:
        with open(path) as f:
            ds = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--deepspeed_config {path} is not valid JSON ({e.msg} at line {e.lineno}); fix the file.") from None
    if not isinstance(ds, dict):
        raise ConfigError(f"--deepspeed_config {path} must hold a JSON object at the top level; fix the file.")
    return ds, path


def _is_auto(v) -> bool:
    return isinstance(v, str) and v.lower() == "auto"


def _as_int(v, key, src):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"{src}: {key} must be a positive integer or \"auto\" (got {v!r}); fix the JSON.")
    return v


def auto_buckets(hidden: int) -> dict[str, int]:
    """DeepSpeed's "auto" bucket sizes and ZeRO-3 persistence threshold from the hidden size (the rule of Hugging
    Face's DeepSpeed integration); the planner charges the same buffers."""
    return {
        "reduce_bucket_size": hidden * hidden,
        "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
        "stage3_param_persistence_threshold": 10 * hidden,
        "allgather_bucket_size": hidden * hidden,
    }


def resolve_deepspeed(cfg, layout, n_embd: int) -> DeepSpeedSpec:
    """Read cfg.deepspeed_config and fill it from the flags and the layout; raise ConfigError (one sentence
    naming the fix) on anything that contradicts them or cannot work. `n_embd` sizes the "auto" buckets."""
    check_deepspeed_version()
    ds, src = load_ds_json(cfg.deepspeed_config)
    for key in [k for k in ds if k.startswith("_")]:  # "_comment" and the like: notes for people
        del ds[key]
    _refuse_unsupported(ds, cfg, src)
    bf16 = _precision(ds, cfg, src)
    plan = _batch(ds, cfg, layout, src)
    # clipping: ours, global over dp × tp × pp (see the module docstring); DeepSpeed's is turned off
    clip = _take(ds, "gradient_clipping", "grad_clip", cfg.grad_clip, cfg, src, float)
    if clip < 0:
        raise ConfigError(f"{src}: gradient_clipping must be >= 0 (got {clip}); fix the JSON.")
    ds["gradient_clipping"] = 0.0
    adam = _optimizer(ds, cfg, src)
    stage, off_opt, off_par = _zero(ds, src, n_embd, bf16)
    # quiet, deterministic housekeeping
    ds.setdefault("steps_per_print", 2**31 - 1)
    ds.setdefault("wall_clock_breakdown", False)
    leftover = [k for k, v in _walk(ds) if _is_auto(v)]
    if leftover:
        raise ConfigError(f"{src}: {', '.join(leftover)} cannot be \"auto\"; give concrete values.")
    resolved = dataclasses.replace(  # the flags as the JSON settles them
        cfg, precision="bf16" if bf16 else "fp32", grad_clip=float(clip), global_batch=plan.global_batch,
        global_batch_tokens=None, micro_batches=plan.micro_batches, lr=adam.lr, beta1=adam.beta1, beta2=adam.beta2,
        weight_decay=adam.weight_decay)
    return DeepSpeedSpec(
        ds_config=ds, cfg=resolved, plan=plan, zero_stage=int(stage), offload_optimizer=off_opt, offload_param=off_par,
        adamw=adam.decoupled, eps=adam.eps, source=src,
    )


def _take(section: dict, key: str, flag: str | None, flag_value, cfg, src: str, convert=lambda v: v):
    """'auto'/absent -> the flag's value; concrete -> must agree with an explicitly given flag."""
    v = section.get(key, "auto")
    if _is_auto(v):
        section[key] = flag_value
        return flag_value
    v = convert(v)
    if flag is not None and cfg.given(flag) and v != flag_value:
        raise ConfigError(
            f"{src} sets {key}={v!r} but --{flag.replace('_', '-')} is {flag_value!r}; drop one of them or make them agree."
        )
    section[key] = v
    return v


def _refuse_unsupported(ds: dict, cfg, src: str) -> None:
    """Sections trainer3d does itself, or that cannot work under torch's pipeline schedules."""
    if ds.get("scheduler"):
        raise ConfigError(
            f"{src} has a \"scheduler\" section, but trainer3d runs its own warmup + cosine schedule; remove it and "
            "use --lr/--warmup-steps/--min-lr."
        )
    fp16 = ds.get("fp16") or {}
    if fp16.get("enabled") is True or (_is_auto(fp16.get("enabled")) and cfg.precision == "fp16"):
        raise ConfigError(
            f"{src} enables fp16, whose dynamic loss scale DeepSpeed keeps per engine (per pipeline stage, out of "
            "step with the others); use a \"bf16\" section instead."
        )
    if (ds.get("torch_autocast") or {}).get("enabled"):
        raise ConfigError(f"{src} enables torch_autocast; remove it and use the \"bf16\" section.")
    info = SCHEDULES.get(cfg.schedule)
    if info is not None and info.split_backward:
        raise ConfigError(
            f"--schedule {cfg.schedule} splits backward into input and weight passes, which ZeRO's gradient hooks "
            "cannot follow; use 1f1b, gpipe, interleaved-1f1b or looped-bfs with --deepspeed_config."
        )


def _precision(ds: dict, cfg, src: str) -> bool:
    """The "bf16" section against --precision; whether bf16 is on."""
    bf16 = ds.setdefault("bf16", {})
    enabled = bf16.get("enabled", False)
    if _is_auto(enabled):
        enabled = cfg.resolved_precision("cuda" if torch.cuda.is_available() else "cpu") == "bf16"
    if not isinstance(enabled, bool):
        raise ConfigError(f"{src}: bf16.enabled must be true, false or \"auto\"; fix the JSON.")
    bf16["enabled"] = enabled
    precision = "bf16" if enabled else "fp32"
    if cfg.given("precision") and cfg.precision not in ("auto", precision):
        raise ConfigError(
            f"{src} trains in {precision} but --precision is {cfg.precision}; set bf16.enabled in the JSON instead."
        )
    return enabled


def _batch(ds: dict, cfg, layout, src: str) -> BatchPlan:
    """train_batch_size = micro × accumulation × dp, each from the JSON or the flags."""
    dp = layout.dp
    tbs, mbs, gas = (ds.get(k, "auto") for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"))
    tbs = None if _is_auto(tbs) else _as_int(tbs, "train_batch_size", src)
    mbs = None if _is_auto(mbs) else _as_int(mbs, "train_micro_batch_size_per_gpu", src)
    gas = None if _is_auto(gas) else _as_int(gas, "gradient_accumulation_steps", src)
    flag_gb = cfg.global_batch if cfg.global_batch_tokens is None else cfg.global_batch_tokens // max(1, cfg.seq_len)
    gb_given = cfg.given("global_batch") or cfg.global_batch_tokens is not None
    if tbs is not None and gb_given and tbs != flag_gb:
        raise ConfigError(
            f"{src} sets train_batch_size={tbs} but the flags ask for a global batch of {flag_gb} sequences; "
            "drop --global-batch/--global-batch-tokens or set train_batch_size to \"auto\"."
        )
    if gas is not None and cfg.micro_batches is not None and gas != cfg.micro_batches:
        raise ConfigError(
            f"{src} sets gradient_accumulation_steps={gas} but --micro-batches is {cfg.micro_batches} (they are the "
            "same thing here: micro-batches per step); drop one of them or make them agree."
        )
    if tbs is None and mbs is not None and gas is not None:
        tbs = mbs * gas * dp
    if gas is None and tbs is not None and mbs is not None and tbs % (mbs * dp) == 0:
        gas = tbs // (mbs * dp)
    global_batch = tbs if tbs is not None else flag_gb
    if gas is None:
        if cfg.micro_batches is not None:
            gas = cfg.micro_batches
        elif mbs is not None and global_batch % (mbs * dp) == 0:  # what the JSON's micro size implies
            gas = global_batch // (mbs * dp)
        else:  # the DDP path's default: 1 at pp=1, else pp or 2·pp (pp where 2·pp does not split the batch)
            gas = default_micro_batches(cfg.schedule, layout.pp)
            if global_batch % (dp * gas):
                gas = 1 if layout.pp == 1 else layout.pp
    if mbs is None:
        if global_batch % (dp * gas):
            raise ConfigError(
                f"The global batch of {global_batch} sequences does not split into dp={dp} × {gas} micro-batches; "
                f"make train_batch_size (or --global-batch) a multiple of {dp * gas}."
            )
        mbs = global_batch // (dp * gas)
    if global_batch != mbs * gas * dp:
        raise ConfigError(
            f"{src}: train_batch_size {global_batch} != train_micro_batch_size_per_gpu {mbs} × "
            f"gradient_accumulation_steps {gas} × dp {dp}; fix one of them (or set it to \"auto\")."
        )
    ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"] = global_batch, mbs, gas
    return BatchPlan(global_batch=global_batch, micro_batches=gas, micro_batch_size=mbs)


@dataclass(frozen=True)
class AdamSettings:
    lr: float
    beta1: float
    beta2: float
    weight_decay: float
    decoupled: bool  # AdamW's decay
    eps: float


def _optimizer(ds: dict, cfg, src: str) -> AdamSettings:
    """Adam's settings: built by trainer3d (the DDP path's parameter groups), so the section is read, then removed."""
    opt = ds.pop("optimizer", None) or {"type": "AdamW"}
    otype = str(opt.get("type", "AdamW")).lower()
    if otype not in SUPPORTED_OPTIMIZERS:
        raise ConfigError(f"{src}: optimizer type {opt.get('type')!r} is not supported; use \"Adam\" or \"AdamW\".")
    params = dict(opt.get("params") or {})
    lr = _take(params, "lr", "lr", cfg.lr, cfg, src, float)
    betas = _take(params, "betas", None, [cfg.beta1, cfg.beta2], cfg, src, lambda v: [float(x) for x in v])
    if len(betas) != 2:
        raise ConfigError(f"{src}: optimizer betas must be two numbers; fix the JSON.")
    if not _is_auto(opt.get("params", {}).get("betas", "auto")):
        for flag, val in (("beta1", betas[0]), ("beta2", betas[1])):
            if cfg.given(flag) and getattr(cfg, flag) != val:
                raise ConfigError(f"{src} sets betas={betas} but --{flag} is {getattr(cfg, flag)}; drop one of them.")
    wd = _take(params, "weight_decay", "weight_decay", cfg.weight_decay, cfg, src, float)
    eps = _take(params, "eps", "adam_eps", cfg.adam_eps, cfg, src, float)
    return AdamSettings(lr=float(lr), beta1=float(betas[0]), beta2=float(betas[1]), weight_decay=float(wd),
                        decoupled=otype == "adamw" or bool(params.get("adam_w_mode", True)),
                        eps=float(eps))


def _zero(ds: dict, src: str, n_embd: int, bf16: bool) -> tuple[int, str, str]:
    """The zero_optimization section: stage, "auto" buckets, offload devices and paths; (stage, optimizer offload,
    parameter offload)."""
    zero = ds.setdefault("zero_optimization", {})
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"{src}: zero_optimization.stage must be 0, 1, 2 or 3 (got {stage!r}); fix the JSON.")
    autos = auto_buckets(n_embd)
    for key, value in list(zero.items()):
        if _is_auto(value):
            if key not in autos:
                raise ConfigError(f"{src}: zero_optimization.{key} cannot be \"auto\"; give a value.")
            zero[key] = autos[key]
    off_opt = (zero.get("offload_optimizer") or {}).get("device", "none") or "none"
    off_par = (zero.get("offload_param") or {}).get("device", "none") or "none"
    for what, dev in (("offload_optimizer", off_opt), ("offload_param", off_par)):
        if dev not in ("none", "cpu", "nvme"):
            raise ConfigError(f"{src}: zero_optimization.{what}.device must be none, cpu or nvme (got {dev!r}).")
    if off_opt != "none" and stage == 0:
        raise ConfigError(f"{src} offloads the optimizer at ZeRO stage 0; set zero_optimization.stage to 1, 2 or 3.")
    if off_par != "none" and stage != 3:
        raise ConfigError(f"{src} offloads parameters, which only ZeRO stage 3 can do; set zero_optimization.stage to 3.")
    if "nvme" in (off_opt, off_par):
        if stage != 3:
            raise ConfigError(f"{src} offloads to NVMe, which needs ZeRO stage 3 (ZeRO-Infinity); set stage to 3.")
        for what, dev in (("offload_optimizer", off_opt), ("offload_param", off_par)):
            if dev != "nvme":
                continue
            path = zero[what].get("nvme_path")
            if not path:
                raise ConfigError(f"{src}: zero_optimization.{what} offloads to nvme but has no nvme_path; add one.")
            if not os.path.isdir(path):
                raise ConfigError(f"{src}: nvme_path {path} ({what}) does not exist; create it or point it at a local NVMe mount.")
            if not os.access(path, os.W_OK | os.X_OK):
                raise ConfigError(f"{src}: nvme_path {path} ({what}) is not writable; fix its permissions or pick another path.")
        if off_par == "nvme" and not bf16 and not torch.cuda.is_available():
            raise ConfigError(
                f"{src} swaps fp32 parameters to NVMe on a host without CUDA, where DeepSpeed 0.19.8 swaps them as "
                "bf16 (partition_parameters.Init._set_dtype) and training crashes; pass --precision bf16 (or enable bf16 in the JSON) or set "
                "offload_param.device to cpu."
            )
        if not aio_available():
            raise ConfigError(
                f"{src} offloads to NVMe, which needs DeepSpeed's async_io op, and it can neither be loaded nor built "
                "here (libaio missing); `apt-get install libaio-dev`, then `python -m trainer3d.zero --build-ops`."
            )
    for what, dev in (("offload_optimizer", off_opt), ("offload_param", off_par)):
        if dev != "none" and not torch.cuda.is_available():
            zero[what]["pin_memory"] = False  # page-locking helps host<->GPU copies only; a CPU host has none
    return stage, off_opt, off_par


def _walk(obj, prefix=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk(v, f"{prefix}{k}.")
    else:
        yield prefix.rstrip("."), obj


