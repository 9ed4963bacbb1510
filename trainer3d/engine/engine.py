"""trainer3d as the training side of another program (an RL framework's actor, a preference-optimization loop): the
few calls such a backend needs (verl's engine, slime's actor), at every layout and engine a training run has.

    engine = Engine(TrainConfig(init_from_hf="my-model", tp=2, pp=2, global_batch=8, seq_len=512, lr=1e-6))
    lp = engine.logprobs(tokens)                        # [B, T]: log p(tokens[:, t+1] | tokens[:, :t+1])
    lps = engine.logprobs([seq_a, seq_b, seq_c])        # rollouts of any count and length: [len - 1] each
    loss = engine.forward_backward(tokens, loss_fn, mask=mask, fields={"advantages": adv, "old_logprobs": lp})
    engine.step()                                       # {"grad_norm", "lr", "loss", "skipped"}
    for hf_name, tensor in engine.named_weights(): ...  # to an inference engine
    engine.offload(); ...; engine.onload()              # the device to a colocated rollout engine, and back
    engine.save(out_dir); engine.close()

verl drives the same calls through its own engine interface (engine/verl_engine.py). Every rank of the job
(torchrun, SLURM, the deepspeed launcher) runs the same calls with the same batch: the whole
global batch (tokens [global_batch, seq_len + 1]), or rollouts, a list of 1-D token tensors of any count and lengths
up to seq_len + 1, which batch.pack places into as many passes of such rows as they need (several a row under
document_mask + reset_position_ids), balanced over dp ranks. The engine takes this dp rank's rows, runs the pipeline
schedule over them in the config's micro-batches, and gives every rank the whole result. Per-token values travel with their tokens through
the schedule as extra channels of the targets ([B, T, channels]: the target, the row, the position, the loss weight,
the caller's fields), so context parallelism's split of the sequence and pipeline parallelism's last stage need no
rule of their own: the loss function sees its micro-batch's tokens wherever they are, and the results are written
back by (row, position) and summed over the world once, one writer per token.

`loss_fn(logprobs, fields) -> per-token losses`: logprobs [mb, T'] of this micro-batch's tokens on this rank (T' =
seq_len, or seq_len/cp), fields the caller's [mb, T'] tensors split alike (and "mask"). The engine weights each
token's loss by the aggregation, from the whole batch on the host: token-mean (1/N, N the global count of masked
tokens: DAPO, Dr. GRPO), sequence-mean (1/(n_seq · n_i), n_i the masked tokens of the token's sequence: GRPO), sum;
so the gradient is that of the aggregated loss over the global batch at every layout. A sequence is a document of a
packed row (the call's `documents`, or those the eos_id opens under --document-mask), else the row; each rollout is
one. Several passes or calls before one step() add up at every engine: ZeRO-0/1/2's reduction at DeepSpeed's
accumulation boundary is held back to step() (ZeroEngine.hold_boundary), since each boundary replaces the last.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

import torch

from trainer3d.checkpoint.load import apply, prepare
from trainer3d.checkpoint.peft import peft_config
from trainer3d.checkpoint.save import save_checkpoint
from trainer3d.config import TrainConfig
from trainer3d.distributed.collectives import all_reduce
from trainer3d.distributed.topology import LaunchEnv, WorldGroup, default_device
from trainer3d.engine.batch import (
    Packing, check_ids, check_rollout_values, check_rollouts, pack, token_weights,
)
from trainer3d.engine.weights import WeightStream
from trainer3d.errors import ConfigError, TrainingError
from trainer3d.parallel.cross_entropy import vocab_parallel_entropy
from trainer3d.parallel.lora import LoRASpec, adapters_off
from trainer3d.train.setup import validate
from trainer3d.train.trainer import Trainer

TARGET, ROW, POSITION, WEIGHT, FIELDS = 0, 1, 2, 3, 4  # the channels of the targets a pass carries

LossFn = Callable[[torch.Tensor, dict], torch.Tensor]
Tokens = torch.Tensor | list[torch.Tensor]  # the whole global batch [global_batch, seq_len + 1], or rollouts


class Engine:
    """One model at one layout, trained by a caller's loss. Construct it on every rank of the job (a collective);
    `ranks`: the global ranks it lives on, where one world holds several (tests); `vocab_size`: the tokenizer's
    (default: the --init-from-hf model's vocabulary, else GPT-2's); `eos_id`: the token that opens a document, which
    --document-mask needs when no `documents` are passed."""

    def __init__(self, cfg: TrainConfig, vocab_size: int | None = None, ranks: list[int] | None = None,
                 eos_id: int | None = None):
        env = LaunchEnv.from_environ()
        n = len(ranks) if ranks else env.world_size
        self.setup = validate(cfg, n)  # before any process group: bad input fails here
        base = self.setup.base_model
        self.vocab_size = vocab_size or (base.vocab_size if base is not None else 50257)
        if getattr(self.setup.model_config(self.vocab_size), "mtp_layers", 0):
            raise ConfigError("The engine trains the model's own head: build it without multi-token prediction "
                              "(mtp_loss_coef=0).")
        self.eos_id, self.passes = eos_id, 0
        self.device = default_device(env.local_rank)
        self.group = WorldGroup(env, self.device, cfg.dist_timeout)
        self.topo = self.group.topology = self.setup.topology(ranks)
        self.trainer = self._build(self.setup) if self.topo.active else None
        self._stream: WeightStream | None = None  # built at the first named_weights()
        self.offloaded: dict | None = None  # what offload() moved, until onload()

    @property
    def active(self) -> bool:
        """Whether this rank is one of the engine's (always, unless `ranks` names a part of the world)."""
        return self.trainer is not None

    def _build(self, setup) -> Trainer:
        mcfg = setup.model_config(self.vocab_size)
        start = prepare(setup.cfg, mcfg, self.topo)  # --resume / --init-from-hf
        # without an eos_id no token opens a document (-1): the calls then pass their `documents`
        boundary = self.eos_id if self.eos_id is not None else -1
        trainer = Trainer(setup, self.topo, self.device, mcfg, shard_value=start.shard_value, boundary=boundary)
        apply(start, trainer)
        trainer.engine.zero_grad()
        trainer.engine.hold_boundary(True)  # several passes a step (ZeRO-0/1/2 reduce once, in step())
        return trainer

    # ---- passes ----------------------------------------------------------------------------------------------
    def _targets(self, tokens: torch.Tensor, weights: torch.Tensor, fields: dict) -> torch.Tensor:
        """[B, T, 4 + fields] float64: target id, row, position, weight, then each field."""
        B, T = tokens.shape[0], tokens.shape[1] - 1
        rows = torch.arange(B, dtype=torch.float64)[:, None].expand(B, T)
        positions = torch.arange(T, dtype=torch.float64)[None, :].expand(B, T)
        channels = [tokens[:, 1:].double(), rows, positions, weights.double()]
        return torch.stack(channels + [f.double().expand(B, T) for f in fields.values()], dim=-1)

    def _sequences(self, tokens: torch.Tensor, documents: torch.Tensor | None) -> torch.Tensor | None:
        """[B, T] the document of each predicted token's context (the one its attention sees), where rows are packed
        (the Trainer's rule: the call's `documents`, or those the eos_id opens under --document-mask); else None."""
        docs = self.trainer.documents_of(tokens, documents)
        return None if docs is None else docs[:, :-1]

    def _check(self, tokens: torch.Tensor, documents: torch.Tensor | None = None, **per_token) -> None:
        """The caller's tensors, on every rank alike before any pass (inside one, a bad id or shape fails on some
        stage only, or, on a GPU, as a device-side assert): token ids of the whole batch, `documents` beside them,
        `per_token` ([B, T], or [B, 1] for a field) by name."""
        gb, seq, vocab = self.trainer.plan.global_batch, self.trainer.cfg.seq_len, self.trainer.mcfg.vocab_size
        if tokens.dim() != 2 or tuple(tokens.shape) != (gb, seq + 1):
            raise ConfigError(f"tokens must be the whole global batch, [{gb}, {seq + 1}] (global_batch, seq_len + 1); "
                              f"got {list(tokens.shape)}.")
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise ConfigError(f"tokens must be integer token ids; got {tokens.dtype}.")
        check_ids(tokens, vocab, "tokens")
        if documents is not None and tuple(documents.shape) != (gb, seq + 1):
            raise ConfigError(f"documents must be shaped like tokens, [{gb}, {seq + 1}]; got {list(documents.shape)}.")
        for name, value in per_token.items():
            widths = (seq,) if name == "mask" else (seq, 1)  # a field may hold one value a row
            shape = list(value.shape) if torch.is_tensor(value) else f"a {type(value).__name__}"
            if not torch.is_tensor(value) or value.dim() != 2 or value.shape[0] != gb or value.shape[1] not in widths:
                shapes = " or ".join(f"[{gb}, {w}]" for w in widths)
                raise ConfigError(f"{name} must be a tensor {shapes} (global_batch, seq_len: one value per predicted "
                                  f"token{'' if name == 'mask' else ', or per row'}); got {shape}.")

    def _pass(self, tokens, targets, documents, reduction, train: bool, real=None) -> list[torch.Tensor]:
        """This dp rank's rows through the schedule, `reduction(logits, targets)` in the loss's place; `real` [B, T]
        the inputs that are not padding (the MoE balance counts those only; None: all)."""
        t = self.trainer
        if documents is None and t.cfg.uses_documents and self.eos_id is None:
            raise ConfigError("Under document_mask / reset_position_ids pass each call its documents, or give the "
                              "Engine the eos_id that opens one.")
        per = t.plan.global_batch // t.topo.layout.dp
        mine = slice(t.topo.dp_rank * per, (t.topo.dp_rank + 1) * per)
        docs = documents[mine, :-1] if documents is not None else None
        if t.balance is not None and train:
            count = t.plan.global_batch * t.cfg.seq_len if real is None else int(real.sum())
            t.balance.begin_pass(None if real is None else real[mine], count)
        return t.run_pass(tokens[mine, :-1], targets[mine], train, docs, reduction)

    def _gather(self, results: list[torch.Tensor], shape: tuple[int, int], width: int) -> torch.Tensor:
        """The [B, T, width] values the last stage's ranks returned as [n, 2 + width] (row, position, values...), on
        every rank: one writer per token (tp rank 0; each cp rank holds its own positions), one sum."""
        out = torch.zeros(*shape, width, device=self.device)
        if self.trainer.parallel_model.has_last and self.topo.tp_rank == 0 and results:
            got = torch.cat(results)
            out[got[:, 0].long(), got[:, 1].long()] = got[:, 2:].float()
        return all_reduce(out, self.topo.world_group).cpu()

    def _scored(self, logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log-probabilities of the targets, the entropy of each position or None) of the distribution
        softmax(logits / temperature): the entropy first, since the cross-entropy consumes the logits it is given."""
        t = self.trainer
        if temperature != 1.0:
            logits = logits / temperature
        h = (vocab_parallel_entropy(logits, self.topo.tp_group, t.parallel_model.vocab_start, t.mcfg.vocab_size)
             if entropy else None)
        return -t.token_losses(logits, targets[..., TARGET].long()), h

    @staticmethod
    def _check_temperature(temperature) -> None:
        if not isinstance(temperature, (int, float)) or not 0 < temperature < float("inf"):
            raise ConfigError(f"temperature must be a positive number (the rollout's: log-probabilities of "
                              f"softmax(logits / temperature)); got {temperature!r}.")

    def _rollouts(self, sequences: list, documents) -> tuple[Packing, torch.Tensor, list[tuple]]:
        """Rollouts checked (batch.check_rollouts) and packed: the Packing, every pass's [P, rows, width] documents,
        and per pass (tokens, documents where the model masks them else None, real inputs)."""
        t = self.trainer
        if documents is not None:
            raise ConfigError("documents are for whole-batch rows; rollouts are one sequence each (pass none).")
        check_rollouts(sequences, t.cfg.seq_len, t.mcfg.vocab_size)
        packing = pack([len(s) for s in sequences], t.plan.global_batch, t.cfg.seq_len + 1, t.topo.layout.dp,
                       several_a_row=t.cfg.document_mask and t.cfg.reset_position_ids)
        tokens, docs, real = packing.tokens(sequences)
        keep = t.cfg.uses_documents  # the model sees documents only where it masks them
        return packing, docs, [(tokens[p], docs[p] if keep else None, real[p]) for p in range(packing.passes)]

    def logprobs(self, tokens: Tokens, documents: torch.Tensor | None = None, entropy: bool = False,
                 temperature: float = 1.0) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | list:
        """[B, T] float32 log-probabilities of tokens[:, 1:] under softmax(logits / temperature) (the rollout's
        sampling distribution; and, with `entropy`, the entropy of each position's), on every rank; no gradient,
        dropout off. `documents` [B, T + 1]: each token's document, for packed rows under --document-mask.
        Rollouts (a list of 1-D token tensors of any count and lengths up to seq_len + 1): a list of [len - 1]."""
        self._ready()
        self._check_temperature(temperature)
        if isinstance(tokens, (list, tuple)):
            packing, _, passes = self._rollouts(tokens, documents)
            out = packing.unpack(torch.stack([self._score(*batch, temperature, entropy) for batch in passes]))
            return ([o[:, 0] for o in out], [o[:, 1] for o in out]) if entropy else [o[:, 0] for o in out]
        self._check(tokens, documents)
        out = self._score(tokens, documents, None, temperature, entropy)
        return (out[..., 0], out[..., 1]) if entropy else out[..., 0]

    def _score(self, tokens, documents, real, temperature: float, entropy: bool) -> torch.Tensor:
        """[B, T, 1 or 2] log-probabilities (and entropies) of one pass's rows, on every rank."""
        self.trainer.engine.train(False)

        def reduction(logits, targets):
            values = [v for v in self._scored(logits, targets, temperature, entropy) if v is not None]
            return torch.stack([targets[..., ROW], targets[..., POSITION], *[v.double() for v in values]],
                               dim=-1).flatten(0, 1)

        targets = self._targets(tokens, torch.zeros(tokens.shape[0], tokens.shape[1] - 1), {})
        with torch.no_grad():
            return self._gather(self._pass(tokens, targets, documents, reduction, False, real),
                                (tokens.shape[0], tokens.shape[1] - 1), 2 if entropy else 1)

    def forward_backward(self, tokens: Tokens, loss_fn: LossFn, mask=None, fields: dict | None = None,
                         aggregation: str = "token-mean", documents: torch.Tensor | None = None,
                         temperature: float = 1.0, entropy: bool = False, batch_total: float | None = None) -> float:
        """Accumulate the gradient of the aggregated loss Σ_tokens weight · loss_fn(logprobs, fields) over the batch;
        return that loss (on every rank). Whole-batch rows: `mask` [B, T] (default: every token), `fields` {name:
        [B, T] or [B, 1]}. Rollouts (a list of 1-D token tensors): `mask` a list of [len - 1] (or None), `fields`
        {name: a list of [len - 1] tensors or of numbers, one a sequence}. loss_fn gets the fields split as the
        tokens are, with "mask", and with `entropy` the entropy of each position's distribution with its gradient
        ("entropy": an entropy bonus). Log-probabilities and entropy are those of softmax(logits / temperature).
        Several calls before one step() add up; where they split one batch, `batch_total` gives the whole batch's
        masked tokens (token-mean) or sequences (sequence-mean), so that their sum is the batch's aggregated loss."""
        self._ready()
        fields = dict(fields or {})
        taken = [name for name in ("mask", "entropy") if name in fields]
        if taken:
            raise ConfigError(f"'{taken[0]}' is the engine's field (the {taken[0]} argument); name yours otherwise.")
        self._check_temperature(temperature)
        if isinstance(tokens, (list, tuple)):
            packing, docs, passes = self._rollouts(tokens, documents)
            mask = packing.per_token(check_rollout_values(tokens, mask, fields)) > 0  # [P, rows, T]
            # token_weights' rule over the passes' rows, each rollout a document of its row
            weights = token_weights(mask.flatten(0, 1), aggregation, docs[..., :-1].flatten(0, 1),
                                    batch_total).view_as(mask)
            given = {**{k: packing.per_token(v) for k, v in fields.items()}, "mask": mask}
            batches = [(tok, docs, weights[p], {k: v[p] for k, v in given.items()}, real)
                       for p, (tok, docs, real) in enumerate(passes)]
        else:
            self._check(tokens, documents, **({} if mask is None else {"mask": mask}),
                        **{f"fields[{k!r}]": v for k, v in fields.items()})
            B, T = tokens.shape[0], tokens.shape[1] - 1
            mask = torch.ones(B, T, dtype=torch.bool) if mask is None else mask.bool()
            weights = token_weights(mask, aggregation, self._sequences(tokens, documents), batch_total)
            batches = [(tokens, documents, weights, {**fields, "mask": mask}, None)]
        self._probe(loss_fn, [*fields, "mask"], entropy)
        return self._train(batches, loss_fn, temperature, entropy)

    @staticmethod
    def _probe(loss_fn: LossFn, names: list[str], entropy: bool) -> None:
        """loss_fn on a stand-in micro-batch (zeros [1, 2] for the log-probs and each field) on every rank, before
        any pass: one that returns another shape (a scalar, a row's sum) is refused with nothing run, whatever the
        engine (a gradient that ZeRO holds across calls cannot be taken back). The check inside the pass stays for
        a loss_fn whose shape depends on its values."""
        given = {name: torch.zeros(1, 2) for name in names}
        given["mask"] = torch.ones(1, 2, dtype=torch.bool)
        if entropy:
            given["entropy"] = torch.zeros(1, 2)
        with torch.no_grad():
            losses = loss_fn(torch.zeros(1, 2), given)
        if not torch.is_tensor(losses) or tuple(losses.shape) != (1, 2):
            raise _not_per_token(_described(losses))

    def _train(self, batches: list[tuple], loss_fn: LossFn, temperature: float, entropy: bool) -> float:
        """Each pass's (tokens, documents, weights, fields with "mask", real inputs) through forward and backward;
        one all-reduce for the loss and for whether loss_fn, on the last stage, returned another shape or raised.
        Either is raised on every rank after the passes, every stage's backward having run (a pipeline's other
        ranks are not left waiting), and drops the step's gradient so far, earlier calls' too, at every engine."""
        t = self.trainer
        scale = (t.loss_scale.scale if t.loss_scale else 1.0) * t.topo.layout.dp_cp  # the engine averages over dp·cp
        t.engine.train()
        failed: list[Exception] = []  # what loss_fn raised, or the refusal of what it returned, on this rank
        local = torch.zeros(3, device=self.device)  # the loss; whether loss_fn returned another shape; raised
        for tokens, documents, weights, fields, real in batches:
            names = list(fields)

            def reduction(logits, targets):
                logprobs, h = self._scored(logits, targets, temperature, entropy)
                given = {name: targets[..., FIELDS + i].to(logprobs.dtype) for i, name in enumerate(names)}
                given["mask"] = given["mask"] > 0
                if h is not None:
                    given["entropy"] = h.to(logprobs.dtype)
                try:
                    losses = loss_fn(logprobs, given)
                except Exception as e:  # noqa: BLE001 (the caller's error, raised again after the passes)
                    failed.append(e)
                    local[2] = 1.0
                    return logprobs.sum() * 0.0  # every stage's backward still runs: no rank is left waiting
                if not torch.is_tensor(losses) or losses.shape != logprobs.shape:
                    failed.append(_not_per_token(_described(losses)))
                    local[1] = 1.0
                    return logprobs.sum() * 0.0
                return (losses * targets[..., WEIGHT].to(losses.dtype)).sum() * scale

            targets = self._targets(tokens, weights, fields)
            losses = self._pass(tokens, targets, documents, reduction, True, real)
            if t.parallel_model.has_last and self.topo.tp_rank == 0 and losses:
                local[0] += torch.stack([x.detach().float() for x in losses]).sum() / scale
        reduced = all_reduce(local, self.topo.world_group)
        if reduced[1] > 0 or reduced[2] > 0:
            t.engine.zero_grad()
            self.passes = 0
            if failed:
                raise failed[0]
            if reduced[2] > 0:
                raise TrainingError("loss_fn raised on the last pipeline stage (its ranks raise the error); the "
                                    "step's gradient so far is dropped.")
            raise _not_per_token("another shape (on the last pipeline stage)")
        self.passes += 1
        self._loss = reduced[0] + (self._loss if self.passes > 1 else 0.0)
        return float(self._loss)

    def step(self, lr: float | None = None) -> dict:
        """Apply the gradient of the forward_backward calls since the last step: dp reduction, clip to --grad-clip,
        AdamW at the schedule's lr (lr_at of the step count), or at `lr` (a caller's own schedule: verl's).
        {"grad_norm", "lr", "loss", "skipped"} (and a MoE's routing statistics, as training logs them); a non-finite loss or norm skips the update and, under
        --on-nonfinite stop (the default), raises TrainingError, as training does (Trainer.optimizer_step)."""
        self._ready()
        t = self.trainer
        if lr is not None and not (isinstance(lr, (int, float)) and 0 <= lr < float("inf")):
            raise ConfigError(f"lr must be a number >= 0; got {lr!r}.")
        if not self.passes:
            raise TrainingError("step() without a forward_backward since the last step: there is no gradient.")
        result = None
        try:  # the Trainer's step (lr schedule, clip, fp16's scale, non-finite rule); the gradient is spent either way
            t.engine.release_boundary()  # ZeRO-0/1/2: the reduction the passes held back (hold_boundary)
            result, lr = t.optimizer_step(self._loss.to(self.device), torch.zeros((), device=self.device), lr=lr)
        finally:
            t.engine.zero_grad()
            self.passes = 0
            stepped = result is not None and result.stepped
            balance = t.balance.end_step(stepped) if t.balance is not None else {}  # MoE: routing statistics
            if t.dsa is not None:  # DeepSeek Sparse Attention: the indexers' loss
                balance.update(t.dsa.end_step())
        return {"grad_norm": result.grad_norm, "lr": lr, "loss": result.loss, "skipped": not result.stepped, **balance}

    def offload(self) -> dict:
        """Between steps, parameters, gradients and optimizer state to host memory, so that a rollout engine on the
        same GPUs has the device (verl's colocated rollout); onload() brings them back, and until then the engine's
        other calls are refused. DDP moves every tensor into pinned host memory; DeepSpeed uses its offload_states.
        Returns the bytes moved (DDP) or held before (DeepSpeed) by kind; on a CPU nothing moves."""
        if self.passes:
            raise TrainingError("offload() between forward_backward and step(): step() first (the gradient is held).")
        if self.offloaded is None:
            self.offloaded = self.trainer.engine.offload()
        return self.offloaded

    def onload(self) -> None:
        if self.offloaded is not None:
            self.trainer.engine.onload()
            self.offloaded = None

    def _ready(self) -> None:
        if self.offloaded is not None:
            raise TrainingError("The engine is offloaded: call onload() before its other calls.")

    def discard(self) -> None:
        """Drop the gradient of forward_backward calls that no step() used (a caller abandoning a step), at every
        engine: DDP's gradients, and DeepSpeed's partitions and accumulation buffers (ZeroEngine.zero_grad)."""
        if self.passes:
            self.trainer.engine.zero_grad()
            self.passes = 0

    # ---- weights and checkpoints -----------------------------------------------------------------------------
    def named_weights(self, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                      bucket_bytes: int = 1 << 28, adapters: bool = False,
                      base: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, whole tensor) for every weight of the model, on every rank, in `dtype` on `device`
        (the engine's own for a CUDA-IPC or NCCL hand-over; tables stay fp32), per-expert tensors under HF's
        per-expert names. Gathered in buckets of at most `bucket_bytes` (a larger tensor alone): each element moves
        once from its one writer to every rank (engine/weights.py), so a rank holds one bucket at a time. Collective:
        every rank iterates to the end. A LoRA run's weights come merged with its adapters; with `adapters`, the
        adapters alone under PEFT's names, and with `base` the frozen base alone, unmerged (an inference engine
        that applies LoRA itself: the base once, then the adapters after each step, with adapter_config())."""
        self._ready()
        if (adapters or base) and LoRASpec.of(self.setup.cfg) is None:
            raise ConfigError(f"named_weights({'adapters' if adapters else 'base'}=True) streams a LoRA run's "
                              "parts, and this engine trains every weight (no --lora-rank).")
        if adapters and base:
            raise ConfigError("named_weights streams the adapters or the base, not both in one call.")
        if self._stream is None:
            self._stream = WeightStream(self.trainer, self.device)
        yield from self._stream.stream(dtype, device, bucket_bytes, adapters, base)

    def adapters_disabled(self):
        """A context in which the model is the base alone (PEFT's disable_adapter): every call inside scores, or
        trains through, the frozen base; the adapters are back on leaving. LoRA runs only."""
        if LoRASpec.of(self.setup.cfg) is None:
            raise ConfigError("adapters_disabled() turns LoRA adapters off, and this engine trains every weight (no "
                              "--lora-rank).")
        return adapters_off(self.trainer.parallel_model.stages)

    def adapter_config(self) -> dict:
        """A LoRA run's adapter_config.json as PEFT writes it (what `named_weights(adapters=True)` goes with: vLLM's
        LoRA request takes it as its peft_config)."""
        spec = LoRASpec.of(self.setup.cfg)
        if spec is None:
            raise ConfigError("adapter_config() describes LoRA adapters, and this engine trains every weight (no "
                              "--lora-rank).")
        return peft_config(self.trainer.mcfg, spec, self.setup.cfg.init_from_hf)

    def save(self, out_dir: str) -> str:
        """A checkpoint of the model, optimizer and step under `out_dir`/checkpoints (what --resume and
        trainer3d.export read); collective. Returns its directory."""
        self._ready()
        return str(save_checkpoint(self.trainer, out_dir))

    def load(self, checkpoint: str) -> None:
        """Rebuild from a checkpoint (a path, or an --out-dir's latest) as --resume does: weights, optimizer, step."""
        cfg = dataclasses.replace(self.setup.cfg, resume=checkpoint, init_from_hf=None)
        self.trainer = None
        self.trainer, self.passes = self._build(dataclasses.replace(self.setup, cfg=cfg)), 0
        self.offloaded = None  # (a new trainer, on the device)
        self._stream = None

    def close(self) -> None:
        self.group.close()


def _described(losses) -> str:
    """What a loss_fn returned, for the refusal."""
    return f"a tensor of shape {list(losses.shape)}" if torch.is_tensor(losses) else f"a {type(losses).__name__}"


def _not_per_token(got: str) -> ConfigError:
    """The one sentence for a loss_fn that does not return one loss per token (before the passes or inside them)."""
    return ConfigError(f"loss_fn must return one loss per token, a tensor shaped like its logprobs argument "
                       f"([micro-batch rows, tokens]); it returned {got}.")
