"""A run's load balancing of its mixtures of experts, and what it reports of their routing.

`--moe-aux-loss-coef c` means what transformers' `router_aux_loss_coef` means (Qwen3-MoE, Mixtral): the loss is c ×
E·Σ_e f_e·P_e over the MoE layers' mean, f_e the share of tokens that chose expert e (Σ_e f_e = k), P_e the mean over
tokens of e's share of the token's router scores; a balanced router gives c·k. A sigmoid router's scores (DeepSeek-V3)
are normalised per token to sum to 1 first, as the DeepSeek-V3 report (eq. 19-20) and Megatron-core's
compute_routing_scores_for_aux_loss do (softmax scores sum to 1 already). (Until 2026-12-06 it read the raw sigmoid
scores: E·s̄ times too strong, s̄ their mean, 4× at 8 experts and 128× at 256 with scores near 0.5, and lowered by
pushing every logit down, which balances nothing.) (It used to be DeepSeek-V3's normalization, 1 a balanced layer,
summed over layers: L/k times transformers', 6× for Qwen3-30B-A3B.) The modes differ only in what f and P are counted
over. Each loss is attached to the MoE block's output by `AuxLossScaler`, which hands its gradient, already scaled, into
the backward wherever the block runs (any pipeline stage, recomputed or not):

- `sequence` (the default), DeepSeek-V3's per-sequence loss: f and P of each sequence, the loss the mean over the
  global batch's sequences. A sequence's statistics never depend on what splits the batch (dp, micro-batches) or the
  sequence (cp, and tp, whose ranks route their own tokens: the counts are all-reduced over both, the scores' sums stay
  local and their gradients are the parts' sums), so it means the same at every layout.
- `global`, the global-batch loss ("Demons in the Detail", Qiu et al. 2025, Qwen3's; Megatron-core's
  global_aux_loss): f counted over every dp, cp and tp rank of the stage (one all-reduce per layer and micro-batch)
  and over the step's micro-batches so far, P that micro-batch's: L = E/N·Σ_m Σ_e f_e^(≤m)·S_e^m, S_e^m the scores of
  e summed over micro-batch m's tokens on every rank, N the step's tokens. Micro-batch m's f is that of micro-batches
  0..m (Megatron's running buffer), since a schedule runs m's backward before later forwards. At one micro-batch a dp
  rank it is the one-process run's loss at every layout; with accumulation, that of one process cutting the same
  micro-batches (tests/test_parity.py's world of 4 holds both). Megatron-core's coefficient is this one times L/k (it
  sums its layers, each balanced at 1).
- `hf`: transformers' `load_balancing_loss_func` on this rank's micro-batch, every layer pooled (E·Σ_e C_e·S_e/(L·N)²)
  for comparing with a transformers run: one stage holding every layer and no tp or cp split (refused otherwise).
- `--moe-z-loss-coef`: ST-MoE's router z-loss, the mean over tokens of logsumexp(logits)², summed over layers.

Padding never counts (transformers' attention_mask, Megatron-core's padding mask): the tokens after a row's length
(`begin_pass`) are routed, their outputs discarded, but they stay out of the loads, the capacity, every loss's f, P and
token count, and the bias's counts.

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
        cfg, topo = trainer.cfg.moe, trainer.topo  # the run's MoEConfig section
        self.trainer, self.topo = trainer, topo
        self.aux_coef, self.aux_mode = cfg.moe_aux_loss_coef, cfg.moe_aux_loss
        self.z_coef, self.bias_rate = cfg.moe_z_loss_coef, cfg.moe_bias_update_rate
        self.capacity_factor = cfg.moe_capacity_factor
        self.blocks = {m.layer: m for s in stages for m in s.modules() if isinstance(m, MoE)}
        self.rows = {layer: i for i, layer in enumerate(trainer.mcfg.moe_layers)}  # every MoE layer of the model
        self.n_experts = trainer.mcfg.moe.n_experts
        self.normalize = trainer.mcfg.moe.score == "sigmoid"  # the loss reads each token's scores summing to 1
        # tokens of a sequence on this rank are 1/split of the dp×cp rank's (tp ranks route their own) and 1/cp of it
        self.split, self.cp = topo.layout.tp, topo.layout.cp
        for block in self.blocks.values():
            block.observer = self
            block.capacity_factor = cfg.moe_capacity_factor
        self._aux = {"sequence": self._sequence_aux, "global": self._global_aux, "hf": self._pooled_aux}[self.aux_mode]
        self._pooled: list[tuple] = []  # hf mode: this micro-batch's layers so far
        self.micro_batch = 0  # the running micro-batch, told by the schedule's stages (parallel/pipeline.py)
        self.padding: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # begin_pass's, per micro-batch
        self.tokens: float | None = None  # the global batch's real input tokens (None: all of its rows' tokens)
        self._begin()

    def _begin(self) -> None:
        device = self.trainer.device
        rows = len(self.rows)
        self.loads = torch.zeros(rows, self.n_experts, dtype=torch.float64, device=device)
        self.dropped = torch.zeros(rows, dtype=torch.float64, device=device)
        self.choices = torch.zeros(rows, dtype=torch.float64, device=device)
        self.losses = torch.zeros(2, dtype=torch.float64, device=device)  # aux, z: this rank's shares of the mean
        self._global_loads: dict[int, torch.Tensor] = {}  # global mode: a layer's loads and tokens of the step so far
        self._global_shares: dict[tuple[int, int], torch.Tensor] = {}  # (layer, micro-batch) -> its f

    # ---- before a pass ------------------------------------------------------------------------------------------
    def begin_pass(self, real: torch.Tensor | None, tokens: int | None = None) -> None:
        """Before a training pass over this dp rank's rows: `real` [rows, seq_len] bool, the input tokens that are not
        padding (None: every one is), and `tokens`, the global batch's count of them (None: all its rows' tokens).
        The mask is cut as the schedule cuts the rows into micro-batches (tensor_split) and as cp and tp cut a row;
        each row's real length is kept whole (a sequence's statistics are the whole sequence's)."""
        self.tokens = None if tokens is None else float(tokens)
        self.padding = None
        if real is None:
            return
        sequence, device = self.trainer.parallel_model.sequence, self.trainer.device
        self.padding = []
        for rows in real.tensor_split(self.trainer.plan.micro_batches):
            local = sequence.split(rows) if sequence is not None else rows
            local = local.chunk(self.split, dim=1)[self.topo.tp_rank]  # the tp rank's own (TokenSplit's, SP's)
            self.padding.append((local.reshape(-1).to(device), rows.sum(1).to(device)))

    def real_tokens(self, block: MoE, n: int) -> torch.Tensor | None:
        """[n] bool: which of the `n` tokens the block routes are not padding (None: all, or not a training pass)."""
        if self.padding is None or not block.training:
            return None
        real = self._pass_padding()[0]
        if real.numel() != n:
            raise RuntimeError(f"an MoE layer routes {n} tokens where the pass's padding mask holds {real.numel()}")
        return real

    # What is looked up by micro-batch or by layer runs eagerly under --compile (a graph break): dynamo would take
    # the int for a constant and compile the block again for each micro-batch and MoE layer, up to its recompile limit
    # (8), after which the rest ran uncompiled; the blocks then share one compiled graph, as dense blocks do.
    @torch.compiler.disable
    def _pass_padding(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The running micro-batch's (token mask, row lengths)."""
        return self.padding[self.micro_batch]

    # ---- during the forward -------------------------------------------------------------------------------------
    def observe(self, block: MoE, routing: Routing, kept: torch.Tensor | None, shape, out: torch.Tensor,
                real: torch.Tensor | None = None):
        """Count the routing and attach the losses; `real` [N] the tokens that are not padding (None: all). A padding
        token's choices become expert E, which every count leaves out."""
        if not block.training:
            return out
        experts = routing.experts if real is None else routing.experts.masked_fill(~real.unsqueeze(1), self.n_experts)
        first = not recomputing()
        if first:
            self._count(block, experts, kept, real)
        terms = []
        if self.aux_coef:
            term = self._aux(block, routing, experts, real, shape)
            if term is not None:
                terms.append((0, term))
        if self.z_coef:
            terms.append((1, self._z_loss(routing, real, shape)))
        if not terms:
            return out
        if first:
            for i, t in terms:
                self.losses[i] += t.detach().double()
        scale = self.trainer.loss_scale.scale if self.trainer.loss_scale else 1.0
        return AuxLossScaler.apply(out, sum(t for _, t in terms) * scale)

    @torch.compiler.disable
    def _count(self, block: MoE, experts: torch.Tensor, kept: torch.Tensor | None, real: torch.Tensor | None) -> None:
        """The step's loads (the bias's counts), choices and drops of this rank's real tokens (no host read)."""
        row = self.rows[block.layer]
        self.loads[row] += expert_counts(experts.reshape(-1), self.n_experts).double()
        self.choices[row] += experts.numel() if real is None else real.sum().double() * experts.shape[1]
        if kept is not None:
            self.dropped[row] += (~kept if real is None else ~kept & real.unsqueeze(1)).sum().double()

    def _per_micro_batch(self) -> float:
        return 1.0 / self.trainer.plan.micro_batches

    def _per_token(self, shape) -> float:
        """A rank's weight of a token in a mean over the step's tokens: dp·cp / N (the engines average over dp×cp)."""
        tokens = self.tokens if self.tokens is not None else (
            shape[0] * shape[1] * self.split * self.trainer.plan.micro_batches * self.topo.layout.dp_cp)
        return self.topo.layout.dp_cp / tokens

    def _real_scores(self, routing: Routing, real: torch.Tensor | None) -> torch.Tensor:
        """[N, E] the scores the balance losses read: each token's share of its scores (a sigmoid router's divided
        by their sum, with Megatron-core's 1e-20), 0 for a padding token."""
        scores = routing.scores
        if self.normalize:
            scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
        return scores if real is None else scores.masked_fill(~real.unsqueeze(1), 0.0)

    def _sequence_aux(self, block: MoE, routing: Routing, experts: torch.Tensor, real, shape) -> torch.Tensor:
        """This rank's share of coef/layers × the mean over the global batch's sequences of E·Σ_e f_e·P_e (scaled so
        that the engines' average over dp×cp, and the tp sum of the router's gradient, give the mean); f and P over
        a sequence's real tokens (a row of padding only adds 0)."""
        E, (batch, tokens), k = self.n_experts, shape[:2], experts.shape[1]
        counts = torch.zeros(batch, E + 1, dtype=torch.float32, device=routing.scores.device)  # column E: padding
        counts.scatter_add_(1, experts.reshape(batch, tokens * k), torch.ones(batch, tokens * k, device=counts.device))
        counts = counts[:, :E].contiguous()
        for group, size in ((self.topo.tp_group, self.split), (self.topo.cp_group, self.cp)):
            if size > 1 and group_size(group) > 1:
                counts = all_reduce(counts, group)  # the whole sequence's loads (no gradient flows through them)
        if real is None:
            length = tokens * self.split * self.cp  # the sequence's tokens
        else:
            length = self._pass_padding()[1].clamp_min(1).unsqueeze(1).float()
        f = counts / length
        p = self._real_scores(routing, real).view(batch, tokens, E).sum(1) / length  # this rank's part of the mean
        coef = self.aux_coef / len(self.rows)
        return coef * E * self.cp * (f * p).sum() / batch * self._per_micro_batch()

    def _global_aux(self, block: MoE, routing: Routing, experts: torch.Tensor, real, shape) -> torch.Tensor:
        """This rank's share of coef/layers × E/N·Σ_e f_e^(≤m)·S_e^m (the module's docstring). The layer's first
        forward of micro-batch m all-reduces its loads and tokens over the stage's ranks; a recomputation reuses f."""
        f = self._global_share(block, experts, real)
        coef = self.aux_coef / len(self.rows)
        return coef * self.n_experts * (f * self._real_scores(routing, real).sum(0)).sum() * self._per_token(shape)

    @torch.compiler.disable
    def _global_share(self, block: MoE, experts: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
        """f^(≤m) of this layer and micro-batch: the loads so far over the stage's ranks, per token."""
        E, key = self.n_experts, (block.layer, self.micro_batch)
        if key not in self._global_shares:
            n = real.sum() if real is not None else torch.tensor(experts.shape[0], device=experts.device)
            wave = torch.cat([expert_counts(experts.reshape(-1), E), n.view(1)]).double()
            wave = all_reduce(wave, self.topo.stage_group)
            so_far = self._global_loads.get(block.layer)
            so_far = wave if so_far is None else so_far + wave
            self._global_loads[block.layer] = so_far
            self._global_shares[key] = (so_far[:E] / so_far[E].clamp_min(1)).float()
        return self._global_shares[key]

    def _z_loss(self, routing: Routing, real: torch.Tensor | None, shape) -> torch.Tensor:
        """This rank's share of coef × the mean over the global batch's real tokens of logsumexp(logits)²."""
        z = torch.logsumexp(routing.logits, dim=-1).square()
        if real is not None:
            z = z.masked_fill(~real, 0.0)
        return self.z_coef * z.sum() * self._per_token(shape)

    @torch.compiler.disable  # the layers it pools are a list that grows by layer
    def _pooled_aux(self, block: MoE, routing: Routing, experts: torch.Tensor, real, shape) -> torch.Tensor | None:
        """transformers' pooled loss (with its attention_mask), once this micro-batch has passed the stage's last MoE
        layer."""
        counts = expert_counts(experts.reshape(-1), self.n_experts).float()
        rows = experts.shape[0] if real is None else real.sum().float()
        self._pooled.append((counts, self._real_scores(routing, real).sum(0), rows))
        if block.layer != max(self.blocks):
            return None
        pooled, self._pooled = self._pooled, []
        rows = sum(n for _, _, n in pooled)
        c = sum(c for c, _, _ in pooled) / rows
        p = sum(p for _, p, _ in pooled) / rows
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
        if self.capacity_factor is not None:
            report["moe_dropped_fraction"] = values[rows + 2]
        self._begin()
        return report
