"""Direct preference optimization (`--objective dpo`; Rafailov et al. 2023), as TRL's DPOTrainer computes it, at every
layout but context parallelism.

A pair's rows are adjacent in its micro-batch (data/preference.py). On the last stage each row's policy log-prob is
the sum of its completion's token log-probs (the vocab-parallel loss's, negated), and its reference log-prob rides
beside its targets in one more column. With h = (π_c - ref_c) - (π_r - ref_r) (ε: --dpo-label-smoothing):
  sigmoid: -(1 - ε)·log σ(β·h) - ε·log σ(-β·h)          (ε = 0: the paper's DPO; ε > 0: cDPO)
  robust:  (-(1 - ε)·log σ(β·h) + ε·log σ(-β·h)) / (1 - 2ε)   (Chowdhury et al. 2024; TRL's "robust")
  ipo:     ((π_c - ref_c)/|c| - (π_r - ref_r)/|r| - 1/(2β))²   (|c|, |r|: the completions' tokens; TRL's)
  hinge:   max(0, 1 - β·h)                                       (SLiC; TRL's "hinge")
  bco_pair: -log σ(β(π_c - ref_c)) - log σ(-β(π_r - ref_r))      (TRL's "bco_pair")
  sppo_hard: (π_c - ref_c - 1/(2β))² + (π_r - ref_r + 1/(2β))²   (SPPO with hard win probabilities; TRL's)
  sft:     the chosen completions' mean token loss over the step's chosen tokens (TRL's "sft": its batch's mean)
--dpo-loss names one or a mix (MPO: "sigmoid,bco_pair"), each weighted by --dpo-loss-weights (default 1 each), as
TRL's loss_type list and loss_weights. The loss is the mean over the global batch's pairs: each micro-batch's sum over its pairs times dp / the global
pairs (the engine averages over dp). TRL's metrics ride in the step's one all-reduce: rewards/chosen = β(π_c - ref_c),
rewards/rejected, rewards/margins and rewards/accuracies (the share of pairs with chosen > rejected), logps/chosen
= π_c and logps/rejected = π_r, means over pairs; logits/chosen and logits/rejected, the logits' mean over the vocabulary
averaged over the completions' tokens.

The reference log-probs are the initial weights' (TRL's ref_model=None; of a LoRA run, the base with the adapters it
starts from, as TRL's frozen "ref" copy of a PEFT model's adapter), or --ref-model's (a Trainer of that model at
the same layout, built, used and dropped before the policy's), scored once before the first step (forward-only passes
over every pair, with the rows' own documents, as training sees them under --document-mask / --reset-position-ids).
They belong to the run's state: every checkpoint holds them (a run table, layout-free), so a --resume at any layout and
into any --out-dir uses the first run's after the weights moved; <out-dir>/dpo_reference.npy is a copy to read. The
--val-data pairs get theirs alike (dpo_val_reference), and evaluate() gives TRL's evaluation of them.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from trainer3d.checkpoint.hf_init import hf_model_config
from trainer3d.data.batch import Batch
from trainer3d.distributed.collectives import all_reduce
from trainer3d.errors import ConfigError, DataError
from trainer3d.fsio import replace_durably, temp_name
from trainer3d.models import canonical_shapes
from trainer3d.train.downstream import forward_rows

LOSSES = ("sigmoid", "robust", "ipo", "hinge", "bco_pair", "sppo_hard", "sft")
SMOOTHED = ("sigmoid", "robust")  # the losses --dpo-label-smoothing's ε enters
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen", "logps/rejected")  # summed
# over pairs in the step's all-reduce; then the logits/* sums and their token counts (means over completion tokens)
TOKEN_METRICS = ("logits/chosen", "logits/rejected")


def loss_mix(cfg) -> list[tuple[str, float]]:
    """--dpo-loss's kinds with --dpo-loss-weights' weights: [(kind, weight)]."""
    kinds = [k.strip() for k in cfg.dpo_loss.split(",")]
    if cfg.dpo_loss_weights is None:
        return [(k, 1.0) for k in kinds]
    try:
        weights = [float(w) for w in cfg.dpo_loss_weights.split(",")]
    except ValueError:
        weights = []
    if len(weights) != len(kinds):
        raise ConfigError(f"--dpo-loss-weights must be {len(kinds)} comma-separated numbers, one per --dpo-loss "
                          f"({cfg.dpo_loss}); got {cfg.dpo_loss_weights!r}.")
    return list(zip(kinds, weights))
TABLES = ("dpo_reference", "dpo_val_reference")  # the reference log-probs of the training and the --val-data pairs,
# as checkpoint run tables and as <out-dir>/<name>.npy copies


class DPO:
    def __init__(self, trainer):
        cfg = trainer.cfg.loss  # the run's LossConfig section
        self.trainer, self.beta, self.mix, self.smoothing = trainer, cfg.dpo_beta, loss_mix(cfg), cfg.dpo_label_smoothing
        self.sums = torch.zeros(len(METRICS) + 2 * len(TOKEN_METRICS), device=trainer.device)  # this pass's, on the last stage's tp rank 0
        self.packed = trainer.cfg.dpo_padding_free  # rows of several pairs (data/preference.py), pairs a step vary
        self.pairs = trainer.plan.global_batch // 2  # a step's (--global-batch counts rows, two a pair; packed: set
        # by targets() for each step)
        self.chosen_tokens = 0.0  # the step's chosen completion tokens (sft's mean over them), set in targets()
        # every row's reference log-prob (load_or_score), checkpointed: the training pairs' and the --val-data pairs'
        self.references: dict[str, np.ndarray] = {}
        self.val_rows = None  # the --val-data pairs (PairRows), which evaluate() scores

    def run_tables(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of the objective (checkpoint/save.py: written whole by rank 0)."""
        return {name: torch.from_numpy(values) for name, values in self.references.items()}

    def load_run_tables(self, read) -> None:
        """From a checkpoint (checkpoint/load.py): `read(name)` a saved run table or None (saved before they were)."""
        for name in TABLES:
            saved = read(name)
            if saved is not None:
                self.references[name] = saved.double().numpy()

    def targets(self, batch: Batch, targets: torch.Tensor) -> torch.Tensor:
        """[B, T + 1] float64: the targets (-1 where not supervised), then each row's reference log-prob; padding-free
        [B, 2T + D]: the targets, each target's document, each document's reference log-prob (D: documents_room).
        Padding-free, the step's pairs (and for sft its chosen tokens) are counted over dp here."""
        if batch.reference is None:
            raise DataError("DPO rows without reference log-probs: score them first (train/dpo.py reference).")
        supervised = (targets >= 0).double()
        if self.packed:
            documents = batch.documents[:, 1:]  # the document of each target token
            counts = per_sequence(supervised, documents, documents_room(targets.shape[1]))
            local = torch.stack([(counts[:, 0::2] > 0).sum().double(), counts[:, 0::2].sum()])
            self.pairs, self.chosen_tokens = (float(x) for x in all_reduce(local.to(self.trainer.device),
                                                                           self.trainer.topo.dp_group))
            return torch.cat([targets.double(), documents.double(), batch.reference.double()], dim=1)
        if any(kind == "sft" for kind, _ in self.mix):  # the step's chosen completion tokens, over dp
            chosen = supervised[0::2].sum().reshape(1).to(self.trainer.device)
            self.chosen_tokens = float(all_reduce(chosen, self.trainer.topo.dp_group))
        return torch.cat([targets.double(), batch.reference.double()[:, None]], dim=1)

    def sequence_sums(self, logits: torch.Tensor, targets: torch.Tensor, packed: bool | None = None) -> torch.Tensor:
        """[sequences, 3]: each sequence's completion log-prob (summed over its tokens), its logits' mean over the
        vocabulary summed over those tokens (TRL's logits/*), and their count, from this rank's logits shard; rows
        [B, T] of targets, or padding-free [B, 2T] of targets and their documents: [B, D, 3], one a document."""
        packed = self.packed if packed is None else packed
        T = logits.shape[1]
        ids = targets[:, :T].long()
        supervised = ids >= 0
        logit_means = self._mean_logits(logits)  # (before the loss consumes the logits)
        policy = -self.trainer.token_losses(logits, ids.clamp(min=0)) * supervised
        per_token = torch.stack([policy, logit_means.to(policy.dtype) * supervised, supervised.to(policy.dtype)], -1)
        if not packed:
            return per_token.sum(dim=1)
        documents = targets[:, T:2 * T].long()
        D = documents_room(T)
        return per_token.new_zeros(len(ids), D, 3).scatter_add_(
            1, documents.clamp(max=D - 1)[..., None].expand_as(per_token), per_token)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, weight: float) -> torch.Tensor:
        """The micro-batch's pairs' summed loss times `weight` (dp / the global pairs, times the loss scale)."""
        T = logits.shape[1]
        sums = self.sequence_sums(logits, targets[:, :2 * T] if self.packed else targets[:, :T])
        reference = targets[:, 2 * T:] if self.packed else targets[:, T]
        policy, reference, logit_sums, tokens = pairs_of(sums, reference.to(sums.dtype), self.packed)
        ratios = policy - reference
        chosen, rejected = ratios[0::2], ratios[1::2]
        sft = -policy[0::2] * (self.pairs / max(self.chosen_tokens, 1.0))  # (times the mean over pairs: per token)
        losses = self.mixed(chosen, rejected, tokens.clamp(min=1), sft)
        with torch.no_grad():
            self.sums += self.metric_sums(chosen, rejected, policy, logit_sums, tokens).to(self.sums)
        return losses.sum() * weight

    def mixed(self, chosen: torch.Tensor, rejected: torch.Tensor, lengths: torch.Tensor,
              sft: torch.Tensor) -> torch.Tensor:
        """[pairs] the --dpo-loss mix of each pair, from its log-ratios π - ref, its rows' completion lengths, and the
        sft term (its chosen side's share of the chosen tokens' mean loss)."""
        return sum(w * (sft if kind == "sft" else self._pair_losses(kind, chosen, rejected, lengths))
                   for kind, w in self.mix)

    @torch.no_grad()
    def metric_sums(self, chosen, rejected, policy, logit_sums, tokens) -> torch.Tensor:
        """TRL's metrics as sums over these pairs (METRICS, then TOKEN_METRICS' sums and token counts), float64: what
        record() turns into means, for a step's micro-batches (summed over the world) and for the --val-data pairs."""
        return torch.stack([t.double() for t in (
            self.beta * chosen.sum(), self.beta * rejected.sum(), (chosen > rejected).float().sum(),
            policy[0::2].sum(), policy[1::2].sum(), logit_sums[0::2].sum(), tokens[0::2].sum(),
            logit_sums[1::2].sum(), tokens[1::2].sum())])

    @torch.no_grad()
    def _mean_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, T] each position's logits' mean over the vocabulary (TRL's logits/* metrics), from this rank's vocab
        shard (its padding past the vocabulary left out) and one sum over tp."""
        t = self.trainer
        real = max(0, min(logits.shape[-1], t.mcfg.vocab_size - t.parallel_model.vocab_start))
        return all_reduce(logits[..., :real].float().sum(-1), t.topo.tp_group) / t.mcfg.vocab_size

    def _pair_losses(self, kind: str, chosen: torch.Tensor, rejected: torch.Tensor,
                     lengths: torch.Tensor) -> torch.Tensor:
        """[pairs] one loss kind's, from the pairs' log-ratios π - ref (the module's docstring)."""
        beta, eps = self.beta, self.smoothing
        h = beta * (chosen - rejected)
        if kind == "sigmoid":
            return -(1 - eps) * F.logsigmoid(h) - eps * F.logsigmoid(-h)  # cDPO (Mitchell 2023); eps 0: DPO
        if kind == "robust":  # Chowdhury et al. 2024
            return (-(1 - eps) * F.logsigmoid(h) + eps * F.logsigmoid(-h)) / (1 - 2 * eps)
        if kind == "ipo":  # per-token log-ratios (TRL's; its rewards stay summed)
            return (chosen / lengths[0::2] - rejected / lengths[1::2] - 1 / (2 * beta)) ** 2
        if kind == "hinge":
            return torch.relu(1 - h)
        if kind == "bco_pair":
            return -F.logsigmoid(beta * chosen) - F.logsigmoid(-beta * rejected)
        if kind == "sppo_hard":
            return (chosen - 0.5 / beta) ** 2 + (rejected + 0.5 / beta) ** 2
        raise ValueError(kind)  # (check_dpo refused it)

    def begin_pass(self) -> None:
        self.sums.zero_()

    def record(self, sums: list[float], pairs: int | None = None) -> dict:
        """TRL's names, means over `pairs` (default: the global batch's)."""
        out = {name: value / (pairs or self.pairs) for name, value in zip(METRICS, sums)}
        for i, name in enumerate(TOKEN_METRICS):
            total, tokens = sums[len(METRICS) + 2 * i: len(METRICS) + 2 * i + 2]
            out[name] = total / max(tokens, 1.0)
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        if self.packed and pairs is None:  # padding-free: the step's pairs, which the rows decide
            out["pairs"] = self.pairs
        return out


def documents_room(T: int) -> int:
    """How many documents a padding-free row of T targets can hold, its padding's included (every sequence has a token
    or more), rounded up to pairs: the static width of its per-document sums."""
    return 2 * ((T + 3) // 2)


def per_sequence(values: torch.Tensor, documents: torch.Tensor, D: int) -> torch.Tensor:
    """[B, T] per target -> [B, D] summed per document of its row."""
    return values.new_zeros(values.shape[0], D).scatter_add_(1, documents.clamp(max=D - 1), values)


def pairs_of(sums: torch.Tensor, reference: torch.Tensor, packed: bool) -> tuple[torch.Tensor, ...]:
    """(policy, reference, logit sums, tokens), each [2 · pairs] with pair i's chosen at 2i and rejected at 2i + 1:
    rows' sums (a pair's two rows adjacent) as they are; a padding-free row's per-document sums [B, D, 3] and
    reference [B, D], the documents of the pairs it holds (its chosen documents with a supervised token)."""
    if packed:
        held = (sums[:, 0::2, 2] > 0).repeat_interleave(2, dim=1)
        sums, reference = sums[held], reference[held]
    return sums[:, 0], reference, sums[:, 1], sums[:, 2]


def _row_batches(rows):
    """forward_rows' make_batch over PairRows: inputs, targets (-1 where not supervised; padding-free, their
    documents after them), documents."""
    flat = rows.tokens

    def make_batch(idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        real = np.minimum(idx, len(flat) - 1)
        tokens = torch.from_numpy(flat[real].astype(np.int64))
        supervised = torch.from_numpy(rows.flags[real][:, 1:].astype(bool)) & torch.from_numpy(idx < len(flat))[:, None]
        documents = torch.from_numpy(rows.documents[real].astype(np.int64))  # as the training rows carry them
        targets = tokens[:, 1:].masked_fill(~supervised, -1)
        if rows.packed:
            targets = torch.cat([targets, documents[:, 1:]], dim=1)
        return tokens[:, :-1], targets, documents[:, :-1]

    return make_batch


def _sequence_sums(trainer, rows) -> torch.Tensor:
    """[rows, 3] (or padding-free [rows, D, 3]): DPO.sequence_sums of every row of `rows` under the current weights,
    forward-only, every rank getting every value."""
    dpo, D = trainer.objective, documents_room(rows.tokens.shape[1] - 1)
    width = 3 * D if rows.packed else 3
    out = forward_rows(trainer, len(rows.tokens), _row_batches(rows),
                       lambda lg, tg: dpo.sequence_sums(lg, tg, rows.packed).reshape(len(tg), width), width=width)
    return out.double().cpu().reshape(len(rows.tokens), D, 3) if rows.packed else out.double().cpu()


def reference_logprobs(trainer, rows) -> np.ndarray:
    """[2n] float64 (padding-free [rows, D]): each row's (document's) completion log-prob under the trainer's current
    weights (the reference, before the first step)."""
    return _sequence_sums(trainer, rows)[..., 0].numpy()


def evaluate(trainer) -> dict:
    """TRL's evaluation on the --val-data pairs under the current weights (dropout off, no gradient): the loss (the
    mix of --dpo-loss, a mean over the pairs) as val_loss, and its metrics as val_rewards/*, val_logps/*,
    val_logits/*, each a mean over the pairs (logits/*: over the completions' tokens)."""
    dpo, rows = trainer.objective, trainer.objective.val_rows
    sums = _sequence_sums(trainer, rows)
    policy, reference, logit_sums, tokens = pairs_of(sums, torch.from_numpy(dpo.references[TABLES[1]]), rows.packed)
    ratios = policy - reference
    chosen, rejected = ratios[0::2], ratios[1::2]
    sft = -policy[0::2] * len(chosen) / tokens[0::2].sum().clamp(min=1)  # its mean: the chosen tokens' mean loss
    metrics = dpo.record(dpo.metric_sums(chosen, rejected, policy, logit_sums, tokens).tolist(), pairs=len(chosen))
    return {"val_loss": float(dpo.mixed(chosen, rejected, tokens.clamp(min=1), sft).mean()),
            **{f"val_{name}": value for name, value in metrics.items()}}


def load_or_score(trainer, rows, out_dir: str, fresh: bool, val_rows=None) -> None:
    """Set the reference log-probs of every row of the training pairs and of the --val-data pairs (`val_rows`):
    a resumed run's from its checkpoint (restored into the objective already), --ref-model's (scored into the rows
    before the policy was built), else scored now by the initial weights; written atomically to
    <out_dir>/<table>.npy where scored or not there yet. A checkpoint saved before they were part of it falls back to
    those files."""
    dpo = trainer.objective
    dpo.val_rows = val_rows
    for name, part in zip(TABLES, (rows, val_rows)):
        if part is not None:
            part.reference = dpo.references[name] = _load_or_score_one(trainer, part, name, out_dir, fresh)


def _load_or_score_one(trainer, rows, name: str, out_dir: str, fresh: bool) -> np.ndarray:
    path = Path(out_dir) / f"{name}.npy"
    reference = trainer.objective.references.get(name, rows.reference)
    if reference is None and not fresh:
        if not path.exists():
            raise DataError(f"The checkpoint holds no DPO reference log-probs ({name}: saved by an earlier trainer3d, "
                            f"or before --val-data was given) and {path} does not exist: resume into the first run's "
                            f"--out-dir, or copy its {path.name} there.")
        reference = np.load(path, allow_pickle=False)
    scored = reference is None
    if scored:
        reference = reference_logprobs(trainer, rows)
    shape = (len(rows.tokens), documents_room(rows.tokens.shape[1] - 1)) if rows.packed else (len(rows.tokens),)
    if reference.shape != shape:
        raise DataError(f"The reference log-probs ({name}) score {reference.shape} and this run has {shape} (rows, "
                        "documents); resume with the same preference data, --seq-len and --dpo-padding-free.")
    if trainer.is_logging_rank and (scored or not path.exists()):  # the copy to read, in a resumed run's new dir too
        os.makedirs(out_dir, exist_ok=True)
        tmp = temp_name(path)
        with open(tmp, "wb") as f:
            np.save(f, reference, allow_pickle=False)
        replace_durably(tmp, path)
    return reference


# ---- the flags' rules, before any process group (train/setup.validate calls them) ----------------------------------
def check_dpo(cfg):
    """--objective dpo trains on --data-format preference pairs and nothing else does; its pairs hold nothing out for
    validation (--val-fraction is set to 0): --val-data's pairs are its validation."""
    dpo_flags = [k for k, v in (("dpo_beta", 0.1), ("dpo_loss", "sigmoid"), ("dpo_loss_weights", None),
                                ("dpo_label_smoothing", 0.0), ("ref_model", None), ("dpo_padding_free", False))
                 if getattr(cfg, k) != v]
    if cfg.objective != "dpo":
        if cfg.objective != "lm":
            raise ConfigError(f"--objective must be lm or dpo (got {cfg.objective!r}).")
        if cfg.data_format == "preference":
            raise ConfigError("--data-format preference holds pairs for --objective dpo; add it.")
        if dpo_flags:
            raise ConfigError(f"--{dpo_flags[0].replace('_', '-')} applies to --objective dpo; add it or drop the flag.")
        return cfg
    if cfg.data_format != "preference" or cfg.data is None or cfg.data_mixture:
        raise ConfigError("--objective dpo trains on preference pairs: pass --data-format preference and --data with "
                          "prompt/chosen/rejected rows.")
    mix = loss_mix(cfg)
    unknown = [kind for kind, _ in mix if kind not in LOSSES]
    if unknown or len({kind for kind, _ in mix}) != len(mix):
        raise ConfigError(f"--dpo-loss must name one or more of {', '.join(LOSSES)}, comma-separated, each once (got "
                          f"{cfg.dpo_loss!r}).")
    if cfg.dpo_label_smoothing and not any(kind in SMOOTHED for kind, _ in mix):
        raise ConfigError(f"--dpo-label-smoothing applies to the sigmoid and robust losses; drop it with --dpo-loss "
                          f"{cfg.dpo_loss}.")
    if cfg.cp > 1 or cfg.mtp_loss_coef:
        raise ConfigError("--objective dpo runs without context parallelism and multi-token prediction (a pair's "
                          "log-prob is summed on one rank): drop --cp / --mtp-loss-coef.")
    if cfg.eval_hellaswag:
        raise ConfigError("--objective dpo validates on held-out pairs (--val-data), not HellaSwag: drop "
                          "--eval-hellaswag.")
    if cfg.ref_model is not None and not (Path(cfg.ref_model).expanduser() / "config.json").is_file():
        raise ConfigError(f"--ref-model {cfg.ref_model} is not a Hugging Face model directory (no config.json).")
    # its validation: --val-data's pairs only (no tail of the training pairs is held out); padding-free: each side
    # attends to itself from position 0, as alone (TRL's padding_free restarts the positions)
    documents = dict(document_mask=True, reset_position_ids=True) if cfg.dpo_padding_free else {}
    return dataclasses.replace(cfg, val_fraction=0.0, eval_every=cfg.eval_every if cfg.val_data else 0, **documents)


def check_reference(cfg, mcfg, vocab_size: int) -> None:
    """--ref-model must be the policy's architecture: the same parameters, shape for shape."""
    if cfg.ref_model is None:
        return
    ref = cfg.model_config(vocab_size, base=hf_model_config(cfg.ref_model))
    if canonical_shapes(ref) != canonical_shapes(mcfg):
        raise ConfigError(f"--ref-model {cfg.ref_model} is not the policy's architecture ({mcfg.family}, "
                          f"{mcfg.num_params() / 1e6:.1f}M parameters); pass a model of the same shapes.")


def check_dpo_batch(plan, layout, padding_free: bool = False) -> None:
    """A pair's two rows share a micro-batch: an even number of rows in each (padding-free: a row holds whole pairs);
    and one rank sums a row (--layout auto chose no context parallelism)."""
    if layout.cp > 1:
        raise ConfigError("--objective dpo runs without context parallelism: pass --cp 1 (--layout auto: as a "
                          "constraint).")
    if plan.micro_batch_size % 2 and not padding_free:
        raise ConfigError(f"--objective dpo puts each pair's chosen and rejected rows in one micro-batch, and a "
                          f"micro-batch here holds {plan.micro_batch_size} rows: make --global-batch (rows, two per "
                          "pair) / (dp · --micro-batches) even.")
