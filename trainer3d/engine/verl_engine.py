"""trainer3d as a verl training backend: `Trainer3dEngine` implements verl's BaseEngine (verl/workers/engine/base.py)
on trainer3d.engine, registered in verl's EngineRegistry as backend "trainer3d". verl finds it through its plugin
entry point (pyproject.toml: `verl.plugins`), so a verl job selects it by config alone:

    actor_rollout_ref.actor.strategy=trainer3d
    actor_rollout_ref.actor.engine._target_=trainer3d.engine.verl_engine.Trainer3dEngineConfig
    +actor_rollout_ref.actor.engine.args='[--tp,2,--pp,2,--seq-len,4096,--global-batch,16]'

`args` are trainer3d's own flags (layout, schedule, ZeRO, precision, rows per pass); the model is verl's
model_config.path, the optimizer and lr schedule verl's optimizer config (AdamW; verl's own schedule functions).

A verl loss function reads a micro-batch's log-probs (and entropies) of whole sequences, in verl's padding-free layout,
and returns one aggregated loss. trainer3d's passes see tokens wherever the layout puts them (a pipeline stage, a
context-parallel shard), so the loss is applied through its gradient: (1) one forward pass gives every token's
log-prob and entropy; (2) verl's loss runs on them exactly as verl's own backends run it (verl's micro-batches, its
dp normalization), and autograd gives dL/dlogp and dL/dentropy per token; (3) one forward-backward pass trains
Σ_t (dL/dlogp_t · logp_t + dL/dH_t · H_t), whose gradient in the weights is dL/dθ by the chain rule. Exact at every
layout for any loss of the log-probs and entropies (dropout must be off: both forwards must agree); the price is the
extra forward of (1): an update takes 1.36x the engine's own (bench/verl_backend.md). verl averages gradients over dp (its losses scale by
dp_size), so each rank's dL/dlogp is divided by dp before the pass that sums over the whole batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.torch_functional import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup
from verl.workers.config import EngineConfig
from verl.workers.engine.base import BaseEngine, BaseEngineCtx, EngineRegistry
from verl.workers.engine.utils import detach_tree, postprocess_batch_func, prepare_micro_batches

from trainer3d.checkpoint.hf_init import hf_model_config
from trainer3d.checkpoint.peft import target_parameters
from trainer3d.config.cli import parse_args
from trainer3d.engine.engine import Engine
from trainer3d.errors import ConfigError

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float32": torch.float32, "fp32": torch.float32}
# the flags verl's own configs set, and where
VERL_OWNS = {"init_from_hf": "model.path", "lr": "optim.lr", "weight_decay": "optim.weight_decay",
             "beta1": "optim.betas", "beta2": "optim.betas", "grad_clip": "optim.clip_grad", "seed": "engine.seed",
             "warmup_steps": "optim.lr_warmup_steps", "min_lr": "optim.min_lr_ratio",
             "max_steps": "optim.total_training_steps", "lora_rank": "model.lora_rank", "lora_alpha": "model.lora_alpha",
             "lora_targets": "model.target_modules", "lora_from": "model.lora_adapter_path"}


@dataclass
class Trainer3dEngineConfig(EngineConfig):
    """verl's engine config for this backend: `args`, trainer3d's command-line flags (docs/post_training.md);
    `dtype` (verl's field) is the dtype of the weights get_per_tensor_param streams."""

    strategy: str = "trainer3d"
    args: list[str] = field(default_factory=list)

    def __post_init__(self):
        super().__post_init__()
        if self.strategy != "trainer3d":
            raise ConfigError(f"Trainer3dEngineConfig is the trainer3d backend's (strategy trainer3d); got "
                              f"{self.strategy!r}.")


def lora_fields(model_config) -> dict:
    """verl's LoRA settings (model_config: lora_rank, lora_alpha, target_modules, target_parameters on a mixture's
    experts, lora_adapter_path) as TrainConfig fields, as its FSDP engine hands them to PEFT's LoraConfig; PEFT's
    exclude_modules, which trainer3d does not build, refused."""
    rank = int(getattr(model_config, "lora_rank", 0) or 0)
    if not rank:
        return {}
    if getattr(model_config, "exclude_modules", None):
        raise ConfigError("The trainer3d backend's LoRA targets modules by name and excludes none: drop "
                          "model.exclude_modules (or name fewer model.target_modules).")
    if getattr(model_config, "lora_adapter_path", None):  # (its rank, α and targets are the adapter's, as PEFT's)
        return dict(lora_from=str(model_config.lora_adapter_path))
    targets = model_config.target_modules or []
    targets = [targets] if isinstance(targets, str) else [str(t) for t in targets]
    experts = ["experts"] if getattr(model_config, "target_parameters", None) else []
    return dict(lora_rank=rank, lora_alpha=float(model_config.lora_alpha), lora_targets=",".join(targets + experts))


def train_config(model_config, engine_config, optimizer_config):
    """The TrainConfig of verl's three configs: trainer3d's flags, then the model (and its LoRA) and verl's optimizer
    on top."""
    name = str(getattr(optimizer_config, "optimizer", "AdamW")).lower()
    if name not in ("adamw", "adam_w", "torch.optim.adamw"):
        raise ConfigError(f"The trainer3d backend trains with AdamW; verl's optimizer config names {name!r}.")
    if engine_config.param_offload != engine_config.optimizer_offload:
        raise ConfigError("The trainer3d backend moves parameters, gradients and optimizer state to the host together "
                          "(Engine.offload): set param_offload and optimizer_offload alike.")
    clip = optimizer_config.clip_grad if getattr(optimizer_config, "grad_clip", None) is None \
        else optimizer_config.grad_clip
    try:
        typed = parse_args([str(a) for a in engine_config.args])
    except SystemExit:
        raise ConfigError("Trainer3dEngineConfig.args must be trainer3d's flags (the sentence above names the one "
                          "that is not).") from None
    owned = sorted(set(typed.explicit_flags) & set(VERL_OWNS))
    if owned:
        raise ConfigError(f"--{owned[0].replace('_', '-')} is verl's to set ({VERL_OWNS[owned[0]]}); drop it from "
                          "Trainer3dEngineConfig.args.")
    cfg = dataclasses.replace(
        typed, **lora_fields(model_config), init_from_hf=model_config.local_path, lr=optimizer_config.lr,
        weight_decay=optimizer_config.weight_decay,
        beta1=optimizer_config.betas[0], beta2=optimizer_config.betas[1], grad_clip=clip or 0.0,
        seed=engine_config.seed, warmup_steps=0)  # the lr comes from verl's schedule (Trainer3dEngine.lr_scheduler_step)
    if cfg.dropout:
        raise ConfigError("The trainer3d backend applies verl's loss through a second forward pass, which must see the "
                          "first one's log-probs: train without dropout (--dropout 0).")
    wanted = sorted(getattr(model_config, "target_parameters", None) or [])
    if wanted and cfg.lora_rank:
        mcfg = cfg.model_config(model_config.hf_config.vocab_size, base=hf_model_config(cfg.init_from_hf))
        experts = sorted(target_parameters(mcfg))
        if wanted != experts:
            raise ConfigError(f"model.target_parameters {wanted}: the trainer3d backend's LoRA takes a mixture's "
                              f"experts' stacked weights ({', '.join(experts) or 'this model has none'}) and no other "
                              "parameter.")
    return cfg


def lr_schedule(optimizer_config) -> torch.optim.lr_scheduler.LRScheduler:
    """verl's own schedule (its FSDP engine's rule: constant or cosine, with warmup steps or a warmup ratio) on a
    stand-in optimizer whose lr it sets; trainer3d's AdamW steps at that lr."""
    stand_in = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=optimizer_config.lr)
    total = optimizer_config.total_training_steps
    warmup = optimizer_config.lr_warmup_steps
    if warmup is None or warmup <= 0:
        warmup = int(optimizer_config.lr_warmup_steps_ratio * total)
    kind = getattr(optimizer_config, "lr_scheduler_type", "constant")
    if kind == "constant":
        return get_constant_schedule_with_warmup(optimizer=stand_in, num_warmup_steps=warmup)
    if kind == "cosine":
        return get_cosine_schedule_with_warmup(
            optimizer=stand_in, num_warmup_steps=warmup, num_training_steps=total,
            min_lr_ratio=getattr(optimizer_config, "min_lr_ratio", None) or 0.0,
            num_cycles=getattr(optimizer_config, "num_cycles", 0.5),
            zero_indexed_step=getattr(optimizer_config, "zero_indexed_step", True))
    raise ConfigError(f"lr_scheduler_type must be constant or cosine (verl's); got {kind!r}.")


@EngineRegistry.register(model_type="language_model", backend="trainer3d", device=["cuda", "cpu"])
class Trainer3dEngine(BaseEngine):
    """verl's engine interface on trainer3d.engine.Engine: built (a collective) when verl's worker constructs it."""

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config=None):
        super().__init__()
        self.model_config, self.engine_config = model_config, engine_config
        self.optimizer_config, self.checkpoint_config = optimizer_config, checkpoint_config
        self.cfg = train_config(model_config, engine_config, optimizer_config)
        self.stream_dtype = DTYPES.get(str(engine_config.dtype))
        if self.stream_dtype is None:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}; got {engine_config.dtype!r}.")
        self.mode, self._built, self._saved = None, False, []
        self._build()

    def _build(self) -> None:
        """The model of model_config.path, the optimizer and verl's schedule fresh; offloaded under param_offload
        (verl's backends start so: its contexts load the engine for each call)."""
        self.engine = Engine(self.cfg, vocab_size=self.model_config.hf_config.vocab_size)
        self.topo, self.scheduler = self.engine.topo, lr_schedule(self.optimizer_config)
        if self.engine_config.param_offload:
            self.engine.offload()

    # ---- what verl's worker asks of every backend -----------------------------------------------------------
    def initialize(self):
        """Built at construction (verl's worker asks for the dp rank before it initializes); a second call (verl's
        reset) builds it again."""
        if self._built:
            self.engine.close()
            self._build()
        self._built = True

    @property
    def is_param_offload_enabled(self) -> bool:
        return bool(self.engine_config.param_offload)

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return bool(self.engine_config.optimizer_offload)

    def train_mode(self, **kwargs):
        return _Mode(self, "train", **kwargs)

    def eval_mode(self, **kwargs):
        return _Mode(self, "eval", **kwargs)

    def get_data_parallel_rank(self):
        return self.topo.dp_rank

    def get_data_parallel_size(self):
        return self.topo.layout.dp

    def get_data_parallel_group(self):
        return self.topo.dp_group

    def is_mp_src_rank_with_outputs(self):
        """Every rank holds the outputs (trainer3d.engine gives each rank the whole result); verl collects them
        where its other backends do: tp and cp rank 0 of the last pipeline stage."""
        t = self.topo
        return t.tp_rank == 0 and t.cp_rank == 0 and t.pp_rank == t.layout.pp - 1

    def disable_adapter(self):
        """verl's reference policy when the actor holds it (ref_in_actor, under LoRA): the base alone. Without this,
        BaseEngine's no-op scored the reference with the adapters on: the policy itself, a KL penalty of 0."""
        return self.engine.adapters_disabled() if self.cfg.lora_rank > 0 else contextlib.nullcontext()

    def optimizer_zero_grad(self):
        self.engine.discard()

    def optimizer_step(self):
        """The step at verl's lr; returns the gradient norm before clipping (verl's contract)."""
        return self.engine.step(lr=self.scheduler.get_last_lr()[0])["grad_norm"]

    def lr_scheduler_step(self):
        self.scheduler.step()
        return self.scheduler.get_last_lr()[0]

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        """verl's offload between rollout and training (its train/eval contexts call it under param_offload): to the
        host, trainer3d's Engine.offload moves parameters, gradients and optimizer state together; back, onload."""
        super().to(device=device, model=model, optimizer=optimizer, grad=grad)
        if not (model or optimizer):
            return
        if torch.device(device).type == "cpu":
            self.engine.offload()
        else:
            self.engine.onload()

    # ---- forward and backward -------------------------------------------------------------------------------
    def forward_backward_batch(self, data: TensorDict, loss_function, forward_only=False):
        """verl's batch (this dp rank's sequences, padding-free) through the three steps of the module docstring;
        returns verl's output (model_output in the batch's order, each micro-batch's loss and metrics)."""
        temperature = _scalar(tu.get_non_tensor_data(data=data, key="temperature", default=1.0))
        entropy = bool(tu.get_non_tensor_data(data=data, key="calculate_entropy", default=False))
        mine = [s.cpu() for s in data["input_ids"].unbind()]
        sizes = self._sizes(mine)  # every dp rank's sequence lengths: the gathers below need no exchange of their own
        everyone = [s for rank in self._gather(mine, torch.long, sizes) for s in rank]
        scored = self.engine.logprobs(everyone, entropy=entropy, temperature=temperature)
        logp, ent = scored if entropy else (scored, None)
        start = sum(len(rank) for rank in sizes[: self.topo.dp_rank])
        own = {"log_probs": _verl_layout(logp[start:start + len(mine)])}
        if entropy:
            own["entropy"] = _verl_layout(ent[start:start + len(mine)])

        if loss_function is not None:
            tokens = data["loss_mask"].sum().to(self.engine.device)
            dist.all_reduce(tokens, group=self.topo.dp_group)
            tu.assign_non_tensor(data, batch_num_tokens=tokens.item(), dp_size=self.get_data_parallel_size())
        outputs, grads = self._verl_loss(data, own, loss_function, train=not forward_only)
        if not forward_only:
            self._train(everyone, [[n - 1 for n in rank] for rank in sizes], grads, entropy, temperature)
        return outputs

    def _verl_loss(self, data: TensorDict, own: dict, loss_function, train: bool):
        """verl's loss over verl's micro-batches of this rank's sequences (its prepare_micro_batches, by token budget
        or count as the batch says; local: no collective runs per micro-batch here, so dp ranks need not agree on
        their count); per-token gradients {name: [len] each} where `train`."""
        micro_batches, indices = prepare_micro_batches(data=data, dp_group=None, same_micro_num_in_dp=False)
        order = indices if indices is not None else _chunks([len(mb) for mb in micro_batches])
        grads = {name: [None] * len(values) for name, values in own.items()}
        outputs = []
        for mb, idx in zip(micro_batches, order):
            leaves = {name: torch.cat([values[i] for i in idx]).requires_grad_(train) for name, values in own.items()}
            offsets = torch.tensor([0] + [len(own["log_probs"][i]) for i in idx]).cumsum(0)
            model_output = {name: torch.nested.nested_tensor_from_jagged(v, offsets) for name, v in leaves.items()}
            if loss_function is None:
                loss, metrics = torch.zeros(()), {}
            else:
                loss, metrics = loss_function(model_output=model_output, data=mb, dp_group=self.topo.dp_group)
            if train:
                loss.backward()
                for name, leaf in leaves.items():
                    for i, g in zip(idx, leaf.grad.split([len(own[name][i]) for i in idx])):
                        grads[name][i] = g
            outputs.append({"model_output": detach_tree(model_output), "loss": loss.detach().item(),
                            "metrics": metrics})
        return postprocess_batch_func(output_lst=outputs, indices=indices, data=data), grads

    def _train(self, everyone: list, sizes: list[list[int]], grads: dict, entropy: bool, temperature: float) -> None:
        """Step (3): Σ dL/dlogp · logp (+ dL/dH · H) over the whole batch, dL/d· of every dp rank divided by dp;
        `sizes`: every dp rank's predicted tokens per sequence."""
        dp = self.get_data_parallel_size()
        fields = {}
        for name, field_name in (("log_probs", "dlogp"), ("entropy", "dentropy")):
            if name in grads:
                per_rank = self._gather([g[:-1].float() / dp for g in grads[name]], torch.float32, sizes)
                fields[field_name] = [g for rank in per_rank for g in rank]

        def linear(logprobs, given):
            losses = given["dlogp"] * logprobs
            return losses + given["dentropy"] * given["entropy"] if entropy else losses

        self.engine.forward_backward(everyone, linear, fields=fields, aggregation="sum", temperature=temperature,
                                     entropy=entropy)

    # ---- the dp axis: verl hands each dp rank its own sequences; trainer3d.engine takes the whole batch ----------
    def _sizes(self, tensors: list[torch.Tensor]) -> list[list[int]]:
        """Every dp rank's tensor lengths, on every rank, in dp order: their counts (one all-reduce), then the lengths
        (one padded all-gather: gloo and NCCL alike)."""
        device, dp = self.engine.device, self.topo.layout.dp
        counts = torch.zeros(dp, dtype=torch.long, device=device)
        counts[self.topo.dp_rank] = len(tensors)
        dist.all_reduce(counts, group=self.topo.dp_group)
        lengths = torch.zeros(int(counts.max()), dtype=torch.long, device=device)
        lengths[:len(tensors)] = torch.tensor([len(t) for t in tensors], dtype=torch.long)
        gathered = [torch.empty_like(lengths) for _ in range(dp)]
        dist.all_gather(gathered, lengths, group=self.topo.dp_group)
        return [g.cpu()[:c].tolist() for g, c in zip(gathered, counts.tolist())]

    def _gather(self, tensors: list[torch.Tensor], dtype: torch.dtype,
                sizes: list[list[int]]) -> list[list[torch.Tensor]]:
        """Every dp rank's 1-D tensors of those `sizes` (_sizes), on every rank, in dp order: one padded all-gather."""
        flat = torch.zeros(max(sum(rank) for rank in sizes), dtype=dtype, device=self.engine.device)
        if tensors:
            flat[:sum(len(t) for t in tensors)] = torch.cat(tensors).to(flat.device, dtype)
        gathered = [torch.empty_like(flat) for _ in range(self.topo.layout.dp)]
        dist.all_gather(gathered, flat, group=self.topo.dp_group)
        return [list(g.cpu()[:sum(rank)].split(rank)) for g, rank in zip(gathered, sizes)]

    # ---- weights and checkpoints ----------------------------------------------------------------------------
    def get_per_tensor_param(self, layered_summon: bool = False, base_sync_done: bool = False, **kwargs):
        """(Hugging Face name, whole tensor) on this rank's device in engine_config.dtype, from trainer3d's bucketed
        stream (engine/weights.py), and the adapter config. As verl's FSDP engine: without LoRA, or with
        model.lora.merge, every weight (merged) and None; under LoRA, the base alone while the rollout has none
        (base_sync_done False), then the adapters alone under PEFT's names, each with PEFT's adapter config (the
        peft_config of vLLM's LoRA request)."""
        lora = self.cfg.lora_rank > 0 and not (getattr(self.model_config, "lora", None) or {}).get("merge", False)
        part = {} if not lora else dict(adapters=True) if base_sync_done else dict(base=True)

        def stream():
            with self._loaded():
                yield from self.engine.named_weights(dtype=self.stream_dtype, device=self.engine.device, **part)

        return stream(), self.engine.adapter_config() if lora else None

    @contextlib.contextmanager
    def _loaded(self):
        """On the device for the calls inside, offloaded again after where it was (verl's backends do the same)."""
        offloaded = self.engine.offloaded is not None
        self.engine.onload()
        try:
            yield
        finally:
            if offloaded:
                self.engine.offload()

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None, **kwargs):
        """trainer3d's checkpoint under `local_path` (resharding, atomic); the oldest this engine wrote are removed
        beyond max_ckpt_to_keep."""
        if hdfs_path is not None:
            raise ConfigError("The trainer3d backend saves to a local (or shared) path only: hdfs_path is not read.")
        with self._loaded():
            self._saved.append(self.engine.save(local_path))
        while max_ckpt_to_keep and len(self._saved) > max_ckpt_to_keep:
            old = self._saved.pop(0)
            if self.topo.rank == 0:
                shutil.rmtree(old, ignore_errors=True)

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=False, **kwargs):
        if hdfs_path is not None:
            raise ConfigError("The trainer3d backend loads from a local (or shared) path only: hdfs_path is not read.")
        self.engine.load(local_path)
        self.topo = self.engine.topo


class _Mode(BaseEngineCtx):
    """verl's train/eval context: trainer3d.engine sets the model's mode per call; leaving training drops a
    gradient no step used (verl's zero_grad_on_exit)."""

    def __exit__(self, exc_type, exc_val, exc_tb):
        if self.mode == "train" and (self.zero_grad_on_exit or exc_type is not None):
            self.engine.optimizer_zero_grad()
        super().__exit__(exc_type, exc_val, exc_tb)


def _scalar(value) -> float:
    """verl's temperature: a number, or a tensor of one value per sequence that must all agree."""
    if torch.is_tensor(value):
        if value.numel() and not torch.all(value == value.flatten()[0]):
            raise ConfigError("The trainer3d backend takes one temperature per batch; this one holds several.")
        return float(value.flatten()[0])
    return float(value)


def _verl_layout(values: list[torch.Tensor]) -> list[torch.Tensor]:
    """trainer3d's [len - 1] per sequence to verl's [len]: position t scores token t + 1, and the last position,
    which scores no token of the sequence (verl's losses never read it), holds 0."""
    return [torch.cat([v.float(), v.new_zeros(1, dtype=torch.float32)]) for v in values]


def _chunks(sizes: list[int]) -> list[list[int]]:
    """The batch indices of in-order micro-batches of these sizes."""
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    return [list(range(s, s + n)) for s, n in zip(starts, sizes)]
