"""Multi-token prediction's side of a training step (the model's side: models/deepseek_v3/mtp.py): the tokens the
last stage's MTP modules embed, the targets they are scored on, and how their losses join the main one.

- The last stage embeds t_{i+1..i+D}, which no pipeline send carries (only hidden states cross stages): every rank
  holds its dp rank's rows, so the trainer hands the pass's next tokens to `NextTokens`, which the stage reads by
  micro-batch (the pipeline tells it which one runs: parallel/pipeline.py), as Megatron's last stage reads them from
  its own copy of the batch.
- Depth k's target at position i is t_{i+k+1}: the pass's targets shifted left by k, so unsupervised past the row's
  end and wherever the labels mask them (padding, unsupervised turns); and, where the rows' documents are known,
  unsupervised where t_i and t_{i+k} lie in different documents (the module would read across a boundary, which
  Megatron's per-sequence rolling of packed rows never does).
- L_k is depth k's mean cross-entropy over its supervised targets in the whole global batch, as the main loss is over
  its own (so it means the same at every layout); L_MTP = λ/D·Σ_k L_k joins the main loss in the backward only
  (AuxLossScaler), so the loss a step returns and logs stays the main one, and the mean of the L_k is logged apart.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer3d.config import MTP_LOSS_COEF
from trainer3d.distributed.collectives import all_reduce
from trainer3d.parallel.moe_balance import AuxLossScaler


class NextTokens:
    """What each depth embeds, by micro-batch: [D, mb, T] (depth k's t_{i+k} at position i: the pass's next tokens
    shifted left by k - 1 over the whole row, zeros past its end, then cut to this rank's tokens by `split`, the
    context-parallel layout's), the rows split as the schedule splits its arguments; calling it gives the running
    micro-batch's, or None outside a training pass (the model then predicts nothing more than the next token)."""

    def __init__(self, depth: int, split=None):
        self.depth, self.split = depth, split
        self.micro_batch = 0  # set by the pipeline stage before each forward and backward
        self._chunks: list[torch.Tensor] | None = None

    def begin_pass(self, next_tokens: torch.Tensor, micro_batches: int, device: torch.device) -> None:
        """`next_tokens` [B, T]: t_{i+1} at position i (the targets unmasked), whole rows."""
        depths = [F.pad(next_tokens[:, k:], (0, k)) for k in range(self.depth)]
        if self.split is not None:
            depths = [self.split(ids) for ids in depths]
        stacked = torch.stack(depths).to(device, non_blocking=True)
        self._chunks = list(stacked.tensor_split(micro_batches, dim=1))

    def end_pass(self) -> None:
        self._chunks = None

    @property
    def active(self) -> bool:
        return self._chunks is not None

    def __call__(self) -> torch.Tensor | None:
        return None if self._chunks is None else self._chunks[self.micro_batch]


def shifted_targets(targets: torch.Tensor, depth: int, documents: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T] targets (negative: unsupervised) -> [B, depth·T]: depth k's targets in the k-th block of T columns.
    `documents` [B, T + 1]: each token's document, or None."""
    B, T = targets.shape
    out = []
    for k in range(1, depth + 1):
        shifted = F.pad(targets[:, k:], (0, min(k, T)), value=-1)
        if documents is not None:
            span = max(T - k, 0)
            same = F.pad(documents[:, k:k + span] == documents[:, :span], (0, T - span), value=False)
            shifted = shifted.masked_fill(~same, -1)
        out.append(shifted)
    return torch.cat(out, dim=1)


class MTPLoss:
    """One run's multi-token prediction losses: the targets and weights of each pass, and the per-depth sums the
    loss function adds up (this rank's shares; the trainer reduces them with the step's other scalars)."""

    def __init__(self, depth: int, coef: float, next_tokens: NextTokens, topo, global_batch: int,
                 device: torch.device):
        self.depth, self.coef, self.next_tokens, self.topo = depth, coef, next_tokens, topo
        self.global_batch, self.device = global_batch, device
        self.weights = torch.ones(depth, device=device)
        self.sums = torch.zeros(depth, dtype=torch.float64, device=device)

    def begin_pass(self, tokens: torch.Tensor, targets: torch.Tensor, documents: torch.Tensor | None,
                   micro_batches: int, whole: bool) -> torch.Tensor:
        """The pass's targets [B, (1 + D)·T] (the main ones, then each depth's) from this dp rank's rows `tokens`
        [B, T + 1] and their `targets` [B, T], with the next tokens handed to the last stage. `whole`: every target
        of the global batch is supervised; with no document known either, each depth's count is the rows' (no
        collective), else this rank's counts are summed over dp (one all-reduce of D numbers)."""
        extra = shifted_targets(targets, self.depth, documents)
        B, T = targets.shape
        if whole and documents is None:
            counts = torch.tensor([self.global_batch * max(T - k, 0) for k in range(1, self.depth + 1)],
                                  dtype=torch.float32, device=self.device)
        else:
            local = (extra >= 0).view(B, self.depth, T).sum((0, 2)).float().to(self.device)
            counts = all_reduce(local, self.topo.dp_cp_group) / self.topo.layout.cp
        self.weights = self.topo.layout.dp_cp / counts.clamp(min=1)
        self.sums.zero_()
        self.next_tokens.begin_pass(tokens[:, 1:], micro_batches, self.device)
        return torch.cat([targets, extra], dim=1)

    def end_pass(self) -> None:
        self.next_tokens.end_pass()

    @property
    def in_pass(self) -> bool:
        """A training pass with MTP targets runs (evaluation and forward_only passes have none)."""
        return self.next_tokens.active

    def __call__(self, main: torch.Tensor, token_losses: torch.Tensor, scale: float) -> torch.Tensor:
        """The micro-batch's loss for the backward from its main loss (times fp16's loss `scale` already) and the MTP
        targets' cross-entropies [mb, D·T] (zero where unsupervised): the main loss, carrying λ/D·Σ_k of this rank's
        shares of the L_k (times `scale`) into the backward."""
        by_depth = token_losses.unflatten(1, (self.depth, -1)).sum((0, 2)) * self.weights
        self.sums += by_depth.detach().double()
        return AuxLossScaler.apply(main, by_depth.sum() * (self.coef / self.depth * scale))


def install_mtp(trainer) -> MTPLoss | None:
    """The run's MTPLoss, its NextTokens given to this rank's last stage and told each micro-batch by the schedule
    (ParallelModel.listeners); None for a model without MTP modules (or --mtp-loss-coef 0, which builds none)."""
    depth = getattr(trainer.mcfg, "mtp_layers", 0)
    if not depth:
        return None
    sequence = trainer.parallel_model.sequence
    tokens = NextTokens(depth, sequence.split if sequence is not None else None)
    for stage in trainer.parallel_model.stages:
        if stage.head is not None:
            stage.next_tokens = tokens
    trainer.parallel_model.listeners.append(tokens)
    coef = trainer.cfg.mtp_loss_coef if trainer.cfg.mtp_loss_coef is not None else MTP_LOSS_COEF
    return MTPLoss(depth, coef, tokens, trainer.topo, trainer.plan.global_batch, trainer.device)
