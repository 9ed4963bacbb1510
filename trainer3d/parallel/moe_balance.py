"""A run's load balancing of its mixtures of experts, and what it reports of their routing.

Losses (each attached to the MoE block's output by `AuxLossScaler`, which hands the loss's gradient, already
scaled, into the backward wherever the block runs: any pipeline stage, recomputed or not):

- `--moe-aux-loss sequence` (the default), DeepSeek-V3's per-sequence balance loss: for each sequence s,
  L_s = Σ_e f_se·P_se with f_se = E/(k·T)·(tokens of s routed to e) and P_se the mean score of e over s; a balanced
  router gives 1. The loss is the mean over the global batch's sequences times --moe-aux-loss-coef. Its statistics
  are a sequence's, whatever splits the batch (dp, micro-batches) or the sequence (cp, and tp, whose ranks route
  their own tokens: the counts are all-reduced over both, the scores' sums stay local and their gradients are the
  parts' sums), so it means the same at every layout; transformers' pooled loss does not (its statistics are the
  batch's, so a split batch changes it).
- `--moe-aux-loss hf`: transformers' `load_balancing_loss_func` on this rank's micro-batch, every layer pooled
  (E·Σ_e C_e·P_e/(L·N)², a balanced router gives k), for comparing with a transformers run: one stage holding every
  layer and no tp or cp split (refused otherwise: train/setup.py).
- `--moe-z-loss-coef`: ST-MoE's router z-loss, the mean over tokens of logsumexp(logits)², summed over layers.

Loss-free balancing (`--moe-bias-update-rate γ`, DeepSeek-V3): after every optimizer step each router's selection
bias moves by γ·sign(mean load − load) per expert, the loads counted over the whole step (every micro-batch, dp and
cp rank, once each: recomputation does not count again) and all-reduced with the rest of the step's statistics in one
collective. metrics.jsonl gets, per step: the aux and z losses, each layer's max/mean load, and the share of choices
a capacity factor dropped.
"""

from __future__ import annotations

import torch

from trainer3d.distributed.collectives import all_reduce, group_size
from trainer3d.models.moe import MoE, Routing, expert_counts
from trainer3d.parallel.recompute import recomputing


class AuxLossScaler(torch.autograd.Function):
    """Identity on the block's output; in the backward the loss term `aux` (scaled already) gets gradient 1, so it
    is trained as if added to the model's loss."""

    @staticmethod
    def forward(ctx, out, aux):
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=grad.device)


class MoEBalance:
    """Installed on every MoE block of this rank's stages (`observer`): adds the balancing losses, counts the loads,
    and at the end of each step (`end_step`) reduces the step's statistics, moves the biases and reports them."""

    def __init__(self, trainer, stages):
        cfg, topo = trainer.cfg, trainer.topo
        self.trainer, self.topo = trainer, topo
        self.aux_coef, self.aux_mode = cfg.moe_aux_loss_coef, cfg.moe_aux_loss
        self.z_coef, self.bias_rate = cfg.moe_z_loss_coef, cfg.moe_bias_update_rate
        self.blocks = {m.layer: m for s in stages for m in s.modules() if isinstance(m, MoE)}
        self.rows = {layer: i for i, layer in enumerate(trainer.mcfg.moe_layers)}  # every MoE layer of the model
        self.n_experts = trainer.mcfg.moe.n_experts
        # tokens of a sequence on this rank are 1/split of the dp×cp rank's (tp ranks route their own) and 1/cp of it
        self.split, self.cp = topo.layout.tp, topo.layout.cp
        for block in self.blocks.values():
            block.observer = self
            block.capacity_factor = cfg.moe_capacity_factor
        self._pooled: list[tuple[torch.Tensor, torch.Tensor]] = []  # hf mode: this micro-batch's layers so far
        self._begin()

    def _begin(self) -> None:
        device = self.trainer.device
        rows = len(self.rows)
        self.loads = torch.zeros(rows, self.n_experts, dtype=torch.float64, device=device)
        self.dropped = torch.zeros(rows, dtype=torch.float64, device=device)
        self.choices = torch.zeros(rows, dtype=torch.float64, device=device)
        self.losses = torch.zeros(2, dtype=torch.float64, device=device)  # aux, z: this rank's shares of the mean

    # ---- during the forward -------------------------------------------------------------------------------------
    def observe(self, block: MoE, routing: Routing, kept: torch.Tensor | None, shape, out: torch.Tensor):
        if not block.training:
            return out
        first = not recomputing()
        if first:
            row = self.rows[block.layer]
            self.loads[row] += expert_counts(routing.experts.reshape(-1), self.n_experts).double()
            self.choices[row] += routing.experts.numel()
            if kept is not None:
                self.dropped[row] += (~kept).sum().double()
        terms = []
        if self.aux_coef and self.aux_mode == "sequence":
            terms.append((0, self._sequence_aux(routing, shape[0], shape[1])))
        if self.aux_coef and self.aux_mode == "hf":
            term = self._pooled_aux(block, routing, shape[0] * shape[1])
            if term is not None:
                terms.append((0, term))
        if self.z_coef:
            terms.append((1, self._z_loss(routing, shape[0] * shape[1])))
        if not terms:
            return out
        if first:
            for i, t in terms:
                self.losses[i] += t.detach().double()
        scale = self.trainer.loss_scale.scale if self.trainer.loss_scale else 1.0
        return AuxLossScaler.apply(out, sum(t for _, t in terms) * scale)

    def _per_micro_batch(self) -> float:
        return 1.0 / self.trainer.plan.micro_batches

    def _sequence_aux(self, routing: Routing, batch: int, tokens: int) -> torch.Tensor:
        """This rank's share of coef × the mean over the global batch of the per-sequence balance loss (scaled so
        that the engines' average over dp×cp, and the tp sum of the router's gradient, give the mean)."""
        E, k = self.n_experts, routing.experts.shape[1]
        counts = torch.zeros(batch, E, dtype=torch.float32, device=routing.scores.device)
        counts.scatter_add_(1, routing.experts.reshape(batch, tokens * k),
                            torch.ones(batch, tokens * k, device=counts.device))
        for group, size in ((self.topo.tp_group, self.split), (self.topo.cp_group, self.cp)):
            if size > 1 and group_size(group) > 1:
                counts = all_reduce(counts, group)  # the whole sequence's loads (no gradient flows through them)
        length = tokens * self.split * self.cp  # the sequence's tokens
        f = counts * E / (k * length)
        p = routing.scores.view(batch, tokens, E).sum(1) / length  # this rank's part of the mean score
        return self.aux_coef * self.cp * (f * p).sum() / batch * self._per_micro_batch()

    def _z_loss(self, routing: Routing, tokens: int) -> torch.Tensor:
        """This rank's share of coef × the mean over the global batch's tokens of logsumexp(logits)²."""
        z = torch.logsumexp(routing.logits, dim=-1).square().sum()
        return self.z_coef * z / (tokens * self.split) * self._per_micro_batch()

    def _pooled_aux(self, block: MoE, routing: Routing, tokens: int) -> torch.Tensor | None:
        """transformers' pooled loss, once this micro-batch has passed the stage's last MoE layer."""
        counts = expert_counts(routing.experts.reshape(-1), self.n_experts).float()
        self._pooled.append((counts, routing.scores.sum(0)))
        if block.layer != max(self.blocks):
            return None
        pooled, self._pooled = self._pooled, []
        rows = len(pooled) * tokens
        c = sum(c for c, _ in pooled) / rows
        p = sum(p for _, p in pooled) / rows
        return self.aux_coef * self.n_experts * (c * p).sum() * self._per_micro_batch()

    # ---- after the optimizer step -------------------------------------------------------------------------------
    def end_step(self, stepped: bool) -> dict:
        """Reduce the step's statistics over the world (one all-reduce), move the selection biases (a step that was
        applied), and return the step's report; then start counting the next step."""
        world = self.topo.world_group
        flat = torch.cat([self.loads.reshape(-1), self.dropped, self.choices, self.losses])
        flat = all_reduce(flat, world)
        rows, E = len(self.rows), self.n_experts
        loads = flat[: rows * E].view(rows, E)
        dropped, choices = flat[rows * E: rows * E + rows], flat[rows * E + rows: rows * E + 2 * rows]
        losses = flat[-2:] / self.topo.layout.dp_cp  # every rank's share: the mean over the global batch
        if self.bias_rate and stepped:
            for layer, block in self.blocks.items():
                load = loads[self.rows[layer]]
                block.gate.expert_bias += self.bias_rate * torch.sign(load.mean() - load).float()
        imbalance = loads.max(1).values / loads.mean(1).clamp_min(1e-12)
        dropped_fraction = dropped.sum(0, keepdim=True) / choices.sum().clamp_min(1)
        values = torch.cat([imbalance, losses, dropped_fraction]).tolist()  # the step's one read of them
        report = {"moe_load_max_over_mean": [round(x, 4) for x in values[:rows]], "moe_aux_loss": values[rows],
                  "moe_z_loss": values[rows + 1]}
        if self.trainer.cfg.moe_capacity_factor is not None:
            report["moe_dropped_fraction"] = values[rows + 2]
        self._begin()
        return report
