"""DeepSeek Sparse Attention's side of a training run (the model's side: models/deepseek_v3/indexer.py): the stage
(--dsa-stage), the indexers' loss joined to the backward, and its report.

- `warmup`, the DeepSeek-V3.2 report's dense warm-up: the main attention stays dense and every parameter but the
  indexers' is frozen (requires_grad off before the data-parallel engine is built: DDP and AdamW never hold them, so
  they stay bitwise as loaded); each indexer learns the main attention's distribution over every visible key.
- `sparse`: each query attends to the keys its layer's indexer selects and everything trains, the indexer on its
  detached input, with its KL over the selected keys.

The loss is --dsa-loss-coef × the mean over the model's indexers and the global batch's queries (every position: a
query's attention exists wherever it attends) of KL(p_t ‖ softmax(I_t)), p_t the main attention's probabilities
summed over every head (all-reduced over tp, whose ranks hold the heads) and L1-normalised. It joins the backward
through AuxLossScaler, as the balance loss does, so the step's `loss` stays the language model's and `indexer_loss`
(the mean KL, before the coefficient) is logged apart. Top-k passes no gradient and the indexer reads detached
inputs: the KL trains the indexers only, and the language model's loss everything else.
"""

from __future__ import annotations

import torch

from trainer3d.distributed.collectives import all_reduce
from trainer3d.parallel.moe_balance import AuxLossScaler
from trainer3d.parallel.recompute import recomputing


def indexer_modules(stages) -> list:
    """The attention modules of `stages` that run an indexer of their own."""
    return [m for s in stages for m in s.modules() if getattr(m, "indexer", None) is not None]


def freeze_for_warmup(stages) -> None:
    """The dense warm-up trains the indexers only: every other parameter stops taking gradients."""
    keep = {id(p) for m in indexer_modules(stages) for p in m.indexer.parameters()}
    for s in stages:
        for p in s.parameters():
            p.requires_grad_(id(p) in keep)


class IndexerLoss:
    """Installed as the `observer` of every indexer of this rank's stages: attaches the KL to the attention's output
    and sums the step's mean for the report (`end_step`)."""

    def __init__(self, trainer, stages):
        self.trainer, self.topo = trainer, trainer.topo
        self.coef = trainer.cfg.dsa_loss_coef
        self.indexers = trainer.mcfg.n_indexers
        self.sum = torch.zeros((), dtype=torch.float64, device=trainer.device)
        for m in indexer_modules(stages):
            m.observer = self
            m.dense_warmup = trainer.cfg.dsa_stage == "warmup"

    def over_heads(self, probs: torch.Tensor) -> torch.Tensor:
        """[B, T, S] summed over this rank's heads -> over every head (tp ranks hold the heads; no gradient)."""
        return all_reduce(probs, self.topo.tp_group) if self.topo.layout.tp > 1 else probs

    def attach(self, out: torch.Tensor, kl: torch.Tensor) -> torch.Tensor:
        """`kl` [B, T]: each query's KL, with its gradient into the indexer's scores; `out` the attention's output,
        which carries this rank's share of the loss into the backward."""
        share = kl.sum() / (kl.numel() * self.indexers * self.trainer.plan.micro_batches)
        if not recomputing() and self.topo.tp_rank == 0:  # tp ranks hold the same queries
            self.sum += share.detach().double()
        if not self.coef:
            return out
        scale = self.trainer.loss_scale.scale if self.trainer.loss_scale else 1.0
        return AuxLossScaler.apply(out, share * (self.coef * scale))

    def end_step(self) -> dict:
        """The step's mean KL over every rank (one all-reduce and one read); then start the next step's."""
        total = all_reduce(self.sum, self.topo.world_group) / self.topo.layout.dp_cp
        self.sum = torch.zeros_like(self.sum)
        return {"indexer_loss": total.item()}


def install_dsa(trainer) -> IndexerLoss | None:
    """The run's IndexerLoss where the model has DeepSeek Sparse Attention, else None."""
    if not getattr(trainer.mcfg, "sparse", False):
        return None
    return IndexerLoss(trainer, trainer.parallel_model.stages)
