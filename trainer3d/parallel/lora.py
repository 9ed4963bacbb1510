"""LoRA (Hu et al. 2021), as PEFT's LoraConfig builds it: beside each targeted linear of a frozen base, a trainable
pair y = W x + s · B A x, s = α/r (α/√r rank-stabilized), A [r, in] Kaiming-uniform and B [out, r] zero at the start,
dropout on the pair's input.

Under tensor parallelism a pair is split as its linear (DESIGN.md; Megatron-Bridge's rule):
  - column-parallel: A whole on every rank, B split by rows as the base's output. A x enters the tp region as an
    r-wide activation through a TPEntry (the all-reduce of its gradient; under sequence parallelism the all-gather of
    the r-wide product of this rank's sequence shard), so the pair's collectives carry r columns, not the input's d;
  - row-parallel: A split by columns as the base's input, B whole. B (A_local x_local) is a partial sum added to the
    base's before the one reduction that leaves the region, so the pair adds no collective; B's gradient is a share
    per tp rank (`tp_partial`, summed by the engines).
A fused linear (q|k|v, gate|up) gets one pair per block that Hugging Face holds as a module of its own (the q, k
and v projections), so the model is PEFT's: A stacked [pairs·r, in], B stacked by rows and split per block as the base.
A block no target names gets no pair. Adapter parameters are named `<linear>.lora.A` / `.lora.B`.
Every other nn.Linear of a block is replicated over tp (MLA's latent projections, a shared expert's, a gate): its pairs
are whole on every rank and added by a forward hook; like their base, their gradients are whole, or per-rank shares
summed over tp where the linear sees 1/tp of the tokens (sequence parallelism, a mixture's token split).
A mixture's experts (`experts`, PEFT's target_parameters) get a pair per expert on both stacked weights
(`ExpertLoRA`), split over ep with the experts.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainer3d.errors import ConfigError
from trainer3d.models import build_model, family_of
from trainer3d.models.interface import CausalLM, ColumnParallel
from trainer3d.models.moe import Experts, grouped_mm_applies, leaves_empty_groups, per_expert
from trainer3d.models.seeding import name_seeded_uniform
from trainer3d.parallel.sequence_parallel import ShardedDropout
from trainer3d.parallel.tensor_parallel import (
    ColumnParallelLinear, RowParallelLinear, ShardedDropoutRNG, TPEntry, TPSpec, VocabParallelHead, linear_at,
    to_compute_dtype,
)

ALL_LINEAR = "all-linear"
EXPERTS = "experts"  # the target naming a mixture's stacked expert weights (PEFT's target_parameters)
WEIGHTED = (ColumnParallelLinear, RowParallelLinear, VocabParallelHead, Experts)  # the matmuls hold_base_in casts
MARK = ".lora."  # in every adapter parameter's name, and in no base parameter's
COLUMN, ROW, REPLICATED = "column", "row", "replicated"  # how tp splits a target linear, and so its pairs
EXPERT_PAIRS = dict(zip(Experts.STACKED, ("gate_up", "down")))  # an expert weight -> its pair's name (ExpertLoRA)


@dataclass(frozen=True)
class LoRASpec:
    """The run's adapters (--lora-*): rank, α, dropout, targets (ALL_LINEAR or names), rank-stabilized scaling."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = (ALL_LINEAR,)
    rslora: bool = False

    def __str__(self) -> str:
        return (f"rank {self.rank}, alpha {self.alpha:g}, dropout {self.dropout:g}, targets {','.join(self.targets)}"
                f"{', rslora' if self.rslora else ''}")

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    @classmethod
    def of(cls, cfg) -> LoRASpec | None:
        """From a TrainConfig; None without --lora-rank."""
        if not cfg.lora_rank:
            return None
        targets = tuple(t.strip() for t in cfg.lora_targets.split(",") if t.strip())
        return cls(cfg.lora_rank, float(cfg.lora_alpha), cfg.lora_dropout, targets, cfg.lora_rslora)


def is_adapter(name: str) -> bool:
    return MARK in name


@lru_cache(maxsize=2)
def meta_model(mcfg) -> CausalLM:
    """The model on the meta device, built once per config for the questions asked of its structure here (which
    linears, which experts): read, never changed."""
    with torch.device("meta"):
        return build_model(mcfg)


# ---- which blocks of which linears get a pair ---------------------------------------------------------------------
@dataclass(frozen=True)
class Pair:
    """One adapter pair of a linear: its Hugging Face module name, and the rows of the linear's output it writes."""

    hf_module: str
    rows: int


@dataclass(frozen=True)
class Target:
    """A linear with adapters: `path` in its block; `pairs`, one per Hugging Face module the linear fuses (None
    where that block is not targeted) and `rows`, each such block's output rows; `fused`: B's blocks as tensor
    parallelism splits them."""

    path: str
    pairs: tuple[Pair | None, ...]
    rows: tuple[int, ...]
    fused: tuple[int, ...] | None
    split: str  # COLUMN, ROW or REPLICATED over tp, as the base linear
    in_features: int

    def local_params(self, rank: int, tp: int) -> int:
        """A tp rank's adapter parameters: a column target's A whole and B split, a row target's A split and B
        whole, a replicated target's both whole."""
        n, rows = sum(p is not None for p in self.pairs), sum(p.rows for p in self.pairs if p is not None)
        a, b = n * rank * self.in_features, rows * rank
        return a + b // tp if self.split == COLUMN else a // tp + b if self.split == ROW else a + b


@lru_cache(maxsize=4)
def expert_targets(mcfg, spec: LoRASpec) -> dict[str, tuple[int, int, int]]:
    """The mixtures whose experts take pairs (--lora-targets experts): canonical prefix (`layers.3.mlp.experts`) ->
    (experts, hidden, expert hidden)."""
    if EXPERTS not in spec.targets:
        return {}
    model = meta_model(mcfg)
    return {f"{model.BLOCKS}.{layer}.{path}": m.dims
            for layer, block in model.blocks.items() for path, m in block.named_modules() if isinstance(m, Experts)}


def linear_targets(mcfg, model: CausalLM, layer: str, spec: LoRASpec) -> list[Target]:
    """The targets among the parallel plan's linears of block `layer` (its key in the model's blocks). A linear's
    Hugging Face modules are its family adapter's parts; the leaf of their name or of ours (qkv_proj) is what
    --lora-targets names."""
    block, plan, hf = model.blocks[layer], model.parallel_plan(), family_of(mcfg).hf
    out = []
    for path, split in block_linears(block, plan):
        linear = _linear(block, path)
        parts = hf.parts(mcfg, f"{model.BLOCKS}.{layer}.{path}.weight")
        fused = plan.linears[path].fused if split == COLUMN else None
        rows = [p.rows for p in parts] if len(parts) > 1 else [_out_features(linear)]
        pairs = tuple(Pair(p.name.removesuffix(".weight"), r)
                      if any(names(t, p.name.removesuffix(".weight"), path) for t in spec.targets) else None
                      for p, r in zip(parts, rows))
        if any(pairs):
            if len(parts) > 1:  # one pair per HF module: B's blocks are the base's blocks of the targeted ones
                fused = tuple(b for p, span in zip(pairs, spans(fused, rows)) if p is not None for b in span)
                fused = fused if len(fused) > 1 else None
            out.append(Target(path, pairs, tuple(rows), fused, split, _in_features(linear)))
    return out


def spans(fused: tuple[int, ...] | None, rows: list[int]) -> list[tuple[int, ...]]:
    """The base's fused blocks (each split over tp on its own) that each Hugging Face module's `rows` span, in order:
    one each mostly, three where one module covers q|k|v (Qwen3.5's linear attention). A pair's B is split as those
    blocks, so each tp rank holds the rows of its own output columns."""
    if fused is None:
        return [(r,) for r in rows]
    blocks, out = iter(fused), []
    for r in rows:
        span = []
        while sum(span) < r:
            span.append(next(blocks))
        assert sum(span) == r, (fused, rows)  # (a module's rows are whole blocks of the base)
        out.append(tuple(span))
    return out


def block_linears(block: nn.Module, plan) -> list[tuple[str, str]]:
    """Every linear of a block with its split over tp: the parallel plan's column- and row-parallel ones, then every
    other nn.Linear, replicated (PEFT's all-linear takes them all)."""
    out = [(path, COLUMN if isinstance(style, ColumnParallel) else ROW) for path, style in plan.linears.items()
           if _linear(block, path) is not None]
    return out + [(name, REPLICATED) for name, m in block.named_modules()
                  if type(m) is nn.Linear and name not in plan.linears]


@lru_cache(maxsize=4)
def targets_by_linear(mcfg, spec: LoRASpec) -> dict[str, Target]:
    """Every targeted linear of the model by its canonical prefix (`layers.3.self_attn.qkv_proj`)."""
    model = meta_model(mcfg)
    return {f"{model.BLOCKS}.{layer}.{t.path}": t for layer in model.blocks
            for t in linear_targets(mcfg, model, layer, spec)}


def adapter_shapes(mcfg, spec: LoRASpec) -> dict[str, tuple[int, ...]]:
    """Every adapter parameter's canonical name and full shape."""
    out, r = {}, spec.rank
    for prefix, (E, H, I) in expert_targets(mcfg, spec).items():
        for weight, (inp, outp) in (("gate_up", (H, 2 * I)), ("down", (I, H))):
            out[f"{prefix}{MARK}{weight}.A"], out[f"{prefix}{MARK}{weight}.B"] = (E, r, inp), (E, outp, r)
    for prefix, t in targets_by_linear(mcfg, spec).items():
        pairs = [p for p in t.pairs if p is not None]
        out[f"{prefix}{MARK}A"] = (len(pairs) * spec.rank, t.in_features)
        out[f"{prefix}{MARK}B"] = (sum(p.rows for p in pairs), spec.rank)
    return out


def trained_flops_per_token(mcfg, seq_len: int, spec: LoRASpec | None) -> float:
    """The family's model FLOPs per token of a training step; under LoRA less the weight gradients of the frozen base
    (a third of its matmuls' FLOPs), which nothing computes (the adapters' own are a few per cent of a percent)."""
    frozen = mcfg.flops_per_token(1) / 3 if spec is not None else 0.0
    return mcfg.flops_per_token(seq_len) - frozen


def names(target: str, hf_module: str, path: str) -> bool:
    """Whether a --lora-targets entry names a linear's block: all-linear; PEFT's rule for Hugging Face module names
    (the name, or a suffix of it after a dot); or the leaf of the family's own
    path (qkv_proj, every block it fuses)."""
    return (target == ALL_LINEAR or hf_module == target or hf_module.endswith("." + target)
            or path.rpartition(".")[2] == target)


def _linear(block: nn.Module, path: str):
    """The linear at `path`, before tensor parallelism or after it."""
    return linear_at(block, path, (nn.Linear, ColumnParallelLinear, RowParallelLinear))



def _in_features(linear) -> int:
    return linear.in_features if isinstance(linear, nn.Linear) else linear.weight.tp_spec.full_shape[1]


def _out_features(linear) -> int:
    return linear.out_features if isinstance(linear, nn.Linear) else linear.weight.tp_spec.full_shape[0]


# ---- the pairs ----------------------------------------------------------------------------------------------------
class ColumnLoRA(nn.Module):
    """The pairs of a column-parallel linear: s · [B_j (A x)_j per block], on this rank's output columns. A replicated
    linear's (size 1, no group) are the same with nothing split and no entry into a tp region."""

    def __init__(self, t: Target, spec: LoRASpec, group, size: int, device):
        super().__init__()
        n, r = sum(p is not None for p in t.pairs), spec.rank
        targeted = sum(p.rows for p in t.pairs if p is not None)
        self.A = nn.Parameter(torch.empty(n * r, t.in_features, device=device))
        self.B = nn.Parameter(torch.empty(targeted // size, r, device=device))
        if group is not None:
            self.B.tp_spec = TPSpec(0, (targeted, r), t.fused)
        self.blocks = [(p is not None, rows // size) for p, rows in zip(t.pairs, t.rows)]
        self.rank, self.scale = r, spec.scale
        self.dropout = nn.Dropout(spec.dropout)  # (sequence parallelism swaps it for the per-rank stream)
        self.entry = TPEntry(group) if group is not None else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.entry(F.linear(to_compute_dtype(self.dropout(x)), self.A))
        As, Bs = a.split(self.rank, dim=-1), self.B.split([w for on, w in self.blocks if on], dim=0)
        outs, j = [], 0
        for on, width in self.blocks:
            if on:
                outs.append(F.linear(As[j], Bs[j]))
                j += 1
            else:
                outs.append(a.new_zeros(*a.shape[:-1], width))
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return y * self.scale


class RowLoRA(nn.Module):
    """The pair of a row-parallel linear: s · B (A_local x_local), a partial sum over tp like the base's output."""

    def __init__(self, t: Target, spec: LoRASpec, size: int, rng: ShardedDropoutRNG | None, device):
        super().__init__()
        r, out = spec.rank, t.pairs[0].rows
        self.A = nn.Parameter(torch.empty(r, t.in_features // size, device=device))
        self.A.tp_spec = TPSpec(1, (r, t.in_features))
        self.B = nn.Parameter(torch.empty(out, r, device=device))
        self.B.tp_partial = True  # each rank's product is a share of A x
        self.scale = spec.scale
        # the input is split over tp by columns: each rank's columns draw their own mask
        self.dropout = ShardedDropout(spec.dropout, rng) if rng is not None and size > 1 else nn.Dropout(spec.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = to_compute_dtype(self.dropout(x))
        return F.linear(F.linear(x, self.A), self.B) * self.scale


class _Pair(nn.Module):
    """One projection's per-expert pair: A [E, r, in], B [E, out, r]."""

    def __init__(self, experts: int, rank: int, inp: int, out: int, device):
        super().__init__()
        self.A = nn.Parameter(torch.empty(experts, rank, inp, device=device))
        self.B = nn.Parameter(torch.empty(experts, out, rank, device=device))

    def delta(self, x: torch.Tensor, sizes: list[int] | None, offsets, grad_scale: float) -> torch.Tensor:
        A, B = (_ScaleGrad.apply(w, grad_scale) if grad_scale != 1.0 else w for w in (self.A, self.B))
        A, B = A.to(x.dtype), B.to(x.dtype)  # (autocast does not reach the grouped matmul: cast as it would)
        return per_expert(per_expert(x, A, sizes, offsets), B, sizes, offsets)


class ExpertLoRA(nn.Module):
    """The pairs of a mixture's experts (PEFT's target_parameters on both stacked weights): each expert e's
    SwiGLU with W_e + s · B_e A_e in both projections, the base frozen. Expert parallelism splits the pairs with the
    experts (their gradients scaled by 1/ep as the experts' are)."""

    def __init__(self, experts: Experts, spec: LoRASpec, device):
        super().__init__()
        E, H, I = experts.dims
        self.gate_up = _Pair(E, spec.rank, H, 2 * I, device)
        self.down = _Pair(E, spec.rank, I, H, device)
        self.scale = spec.scale

    def forward(self, x, gate_up, down, counts, sizes, grad_scale: float) -> torch.Tensor:
        """The experts' SwiGLU with the pairs, by autograd: six grouped matmuls where torch._grouped_mm's rules hold
        for the base's and the pairs' shapes (and its weight gradients write empty experts' zeros), else a loop over
        the experts (the one host read of `counts`)."""
        grouped = (grouped_mm_applies(x, gate_up, down) and not leaves_empty_groups(x)
                   and (self.gate_up.A.shape[1] * x.element_size()) % 16 == 0)
        offsets = torch.cumsum(counts, 0, dtype=torch.int32) if grouped else None
        sizes = None if grouped else counts.tolist() if sizes is None else sizes
        h = per_expert(x, gate_up, sizes, offsets) + self.scale * self.gate_up.delta(x, sizes, offsets, grad_scale)
        gate, up = h.chunk(2, dim=-1)
        a = F.silu(gate) * up
        return per_expert(a, down, sizes, offsets) + self.scale * self.down.delta(a, sizes, offsets, grad_scale)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward, the gradient times `scale` backward (an expert's share under expert parallelism)."""

    @staticmethod
    def forward(ctx, w, scale):
        ctx.scale = scale
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


# ---- applying them ------------------------------------------------------------------------------------------------
def apply_lora(stage: CausalLM, spec: LoRASpec | None, group, size: int, rng: ShardedDropoutRNG | None) -> CausalLM:
    """Give every targeted linear of a tensor-parallel stage its pairs (`adapter`, which the linear adds to its
    output), in place; before sequence parallelism, which switches their entries and dropouts to sequence shards."""
    if spec is None:
        return stage
    dev = next(stage.parameters()).device
    for layer, block in stage.blocks.items():
        for t in linear_targets(stage.cfg, stage, layer, spec):
            linear = block.get_submodule(t.path)
            if t.split == REPLICATED:
                linear.lora = ColumnLoRA(t, spec, None, 1, dev)
                linear.register_forward_hook(_add_pairs)
            else:
                linear.lora = ColumnLoRA(t, spec, group, size, dev) if t.split == COLUMN else \
                    RowLoRA(t, spec, size, rng, dev)
        for m in block.modules() if EXPERTS in spec.targets else ():
            if isinstance(m, Experts):
                m.lora = ExpertLoRA(m, spec, dev)
    return stage


def _add_pairs(linear: nn.Linear, args, out: torch.Tensor) -> torch.Tensor:
    """A replicated nn.Linear's output plus its pairs' (the tp linears add theirs in their own forward)."""
    return out + linear.lora(args[0])


def freeze_base(stages: list[nn.Module], input_grads: bool = False) -> None:
    """Only the adapters train: every other parameter stops taking gradients before the data-parallel engine is
    built, so DDP and AdamW (ZeRO's too) hold no gradient, master copy or moment of the base. `input_grads`: the
    embedding's output takes a gradient (transformers' enable_input_require_grads, for the same reason): ZeRO-3's
    backward hook around the first block fires only on an input that does. It costs the first block's input
    gradient, which nothing else needs."""
    for s in stages:
        for name, p in s.named_parameters():
            p.requires_grad_(is_adapter(name))
        if input_grads and s.embedding is not None:
            s.embedding.register_forward_hook(lambda module, args, output: output.requires_grad_(True))


def hold_base_in(stages: list[nn.Module], dtype: torch.dtype) -> None:
    """A frozen base's matmul weights held in the compute dtype (a bf16 run under DDP and autocast): autocast casts an
    fp32 weight to it at every matmul anyway, so the values computed are the same, and the fp32 copy that only the
    optimizer needed goes (half the base's bytes). The parallel linears, the experts and the tp-replicated nn.Linear
    (MLA's latents, a shared expert's gate) alike; not a linear computed in fp32 outside autocast (`keeps_fp32`: DSA's
    indexer head weights), the routers (not linears: fp32 by rule), norms, biases or the embedding (the residual stream keeps
    its dtype)."""
    tied = {id(s.embedding.weight) for s in stages if s.embedding is not None}
    for s in stages:
        for m in s.modules():
            held = isinstance(m, WEIGHTED) or (isinstance(m, nn.Linear) and not getattr(m, "keeps_fp32", False))
            for name in ("weight", *Experts.STACKED):
                p = m._parameters.get(name) if held else None
                if p is not None and not p.requires_grad and p.dim() >= 2 and id(p) not in tied:
                    p.data = p.data.to(dtype)


@contextlib.contextmanager
def adapters_off(stages: list[nn.Module]):
    """The base alone inside the block (PEFT's disable_adapter: verl scores its reference policy so when the actor
    holds it): every pair's scale 0, so each adds exactly nothing (y + 0); restored on leaving."""
    pairs = [m for s in stages for m in s.modules() if isinstance(m, (ColumnLoRA, RowLoRA, ExpertLoRA))]
    scales = [m.scale for m in pairs]
    try:
        for m in pairs:
            m.scale = 0.0
        yield
    finally:
        for m, scale in zip(pairs, scales):
            m.scale = scale


def initial_value(name: str, shape: tuple, seed: int) -> torch.Tensor:
    """PEFT's start, as a pure function of the name: A ~ U(±1/√in) (nn.init.kaiming_uniform_ with a=√5), B = 0."""
    if name.endswith(".B"):
        return torch.zeros(shape)
    bound = 1.0 / math.sqrt(shape[-1])  # (an expert's A [E, r, in]: each expert's as PEFT's [E·r, in])
    return name_seeded_uniform(name, shape, seed, -bound, bound)


def with_adapters(base_value, adapter_value):
    """One `shard_value` hook (parallel/shards.materialize) from the base's and the adapters' (each called only for
    its own names)."""

    def value(name, spec, local_shape, rank, size):
        return (adapter_value if is_adapter(name) else base_value)(name, spec, local_shape, rank, size)

    return value


def check_lora(mcfg, spec: LoRASpec) -> None:
    """Targets that name a linear of this model, and a rank no wider than any linear named (all-linear, as PEFT, gives
    every linear the rank, a 1-wide gate too): one sentence otherwise."""
    model = meta_model(mcfg)
    everything = LoRASpec(spec.rank, spec.alpha, targets=(ALL_LINEAR,))
    linears = [(t.path, p.hf_module) for layer in model.blocks
               for t in linear_targets(mcfg, model, layer, everything) for p in t.pairs]
    experts = expert_targets(mcfg, LoRASpec(spec.rank, spec.alpha, targets=(EXPERTS,)))
    unknown = [t for t in spec.targets if not any(names(t, hf, path) for path, hf in linears)
               and not (t == EXPERTS and experts)]
    if unknown:
        known = sorted({n.rpartition(".")[2] for link in linears for n in link} | ({EXPERTS} if experts else set()))
        raise ConfigError(f"--lora-targets names {unknown[0]}, which is no linear of this {mcfg.family} model; its "
                          f"linears are {', '.join(known)} (or all-linear).")
    named = LoRASpec(spec.rank, spec.alpha, targets=tuple(t for t in spec.targets if t != ALL_LINEAR))
    narrowest = min([(min(t.in_features, *(p.rows for p in t.pairs if p is not None)), t.path)
                     for layer in model.blocks for t in linear_targets(mcfg, model, layer, named)]
                    + [(min(H, I), EXPERTS) for E, H, I in expert_targets(mcfg, spec).values()],
                    default=(spec.rank, ""))
    if spec.rank > narrowest[0]:
        raise ConfigError(f"--lora-rank {spec.rank} is wider than {narrowest[1]} ({narrowest[0]}); a rank above a "
                          "target's width adds parameters and no expressiveness: pick at most "
                          f"{narrowest[0]}.")
