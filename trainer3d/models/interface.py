"""What the rest of trainer3d asks of a model family, and nothing else: parallel/, zero/, checkpoint/, plan/ and train/
name no parameter of any family; they read these declarations.

A family (models/<family>/) provides:
  - a config: a frozen dataclass with the shape fields every family has (`vocab_size`, `n_positions` the context,
    `n_embd`, `n_layer`, `n_head`, `dropout`, `ffn_hidden`, `tie_embeddings`, `kv_width`) and its formulas
    (`num_params`, `flops_per_token`, `layer_flops`, `head_flops`, `layer_activations`), plus fields of its own;
  - its plain model, a `CausalLM` (no distributed code) declaring which top-level parts the first and the last pipeline
    stage hold, and its `ParallelPlan` (which linears are column- or row-parallel, where the attention core is);
  - optionally multi-token prediction (DeepSeek-V3): a config field `mtp_layers` (D) and a model whose last stage,
    given the next tokens (`next_tokens`), emits D more predictions after the logits (models/deepseek_v3/mtp.py);
  - `init_value`, its Hugging Face adapter (`HFAdapter`), presets and a tensor-parallel check: a `ModelFamily`.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping

import torch
import torch.nn as nn


# ---- the parallel plan: declarations that parallel/ interprets --------------------------------------------------------
@dataclass(frozen=True)
class ColumnParallel:
    """An nn.Linear whose output dim is split over tp. `fused`: the sizes of the blocks stacked along the output
    (q|k|v, gate|up), each split over tp on its own so that every rank holds whole heads of each."""

    fused: tuple[int, ...] | None = None


@dataclass(frozen=True)
class RowParallel:
    """An nn.Linear whose input dim is split over tp; its output is summed over tp (a bias is replicated)."""


@dataclass(frozen=True)
class ParallelPlan:
    """`linears`: path inside a block -> style (a path whose module is a mixture of experts in some block is left to
    expert parallelism there). `attention`: the attention module inside a block; it has `core(q, k, v)` (what selective
    recomputation wraps) and `sharded_rng` (the per-tp-rank dropout stream of head-sharded attention). `positions`: a
    learned position embedding of the first stage, looked up per sequence shard under sequence parallelism (None:
    positions are rotary, inside attention). `head_shared`: parameters inside a block replicated over tp that each
    rank applies to its own heads only (Qwen3's q/k norms), so their gradient is a per-rank share summed over tp.
    `tp_entries`: identity modules (nn.Identity) inside a block through which a replicated activation enters the
    head-sharded region without a column-parallel linear (MLA's rope key, one head shared by all): tensor parallelism
    makes each the all-reduce of its gradient (Megatron's f), sequence parallelism the all-gather of the sequence.
    `sharded`: parameters inside a block, no linear's, split along dim 0 as a column-parallel output is (per-head
    or per-channel tables of a head-sharded region: a linear attention's convolution, decays and biases).
    `whole_sequence`: entry (an nn.Identity inside a block) -> the replicated module that reads it, where detached
    activations reach a module computing on the whole sequence on every tp rank (DSA's indexer): sequence parallelism
    makes the entry an all-gather of the sequence, and the module's parameters, seeing every token on every rank,
    keep whole gradients (no tp sum). A path a block lacks is skipped (hybrid stacks). The token embedding and the
    head are always vocab-parallel; every other parameter is replicated over tp."""

    linears: Mapping[str, ColumnParallel | RowParallel]
    attention: str | tuple[str, ...]
    positions: str | None = None
    head_shared: tuple[str, ...] = ()
    tp_entries: tuple[str, ...] = ()
    sharded: Mapping[str, ColumnParallel] = dataclasses.field(default_factory=dict)
    whole_sequence: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def mixer(self, block: nn.Module) -> nn.Module:
        """The block's attention module: the first of `attention`'s paths the block has (a hybrid stack's blocks
        hold either a full attention or a linear one, Qwen3.5's)."""
        paths = (self.attention,) if isinstance(self.attention, str) else self.attention
        for path in paths:
            found = find_module(block, path)
            if found is not None:
                return found
        raise AttributeError(f"the block has none of {paths}")


def find_module(block: nn.Module, path: str) -> nn.Module | None:
    """The submodule at `path`, or None where the block has none there (a hybrid stack's blocks differ)."""
    try:
        return block.get_submodule(path)
    except AttributeError:
        return None


# ---- formulas the planner and the metrics read ------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerActivations:
    """Elements one block saves for its backward, per token (Korthikanti et al. 2022's accounting), by dtype and by
    whether tensor parallelism splits them: `resid` in the residual stream's dtype and `matmul` in the matmul dtype are
    replicated over tp (split by tp under sequence parallelism); `sharded_matmul` is split by tp; `fp32` replicated
    statistics (norms), `sharded_fp32` split ones (attention's log-sum-exp per head). `pair_matmul` and `pair_bytes`:
    what a block keeps per (query, key) pair, on average over the blocks, in the matmul dtype and in fixed bytes
    (attention that masks its keys itself: DSA's selection and its indexer's loss); 0 for a fused causal kernel."""

    resid: int
    matmul: int
    sharded_matmul: int
    fp32: int
    sharded_fp32: int
    pair_matmul: float = 0.0
    pair_bytes: float = 0.0


# ---- the plain model ------------------------------------------------------------------------------------------------
class CausalLM(nn.Module):
    """A family's plain model. Blocks live in a ModuleDict keyed by their global index, so a parameter's name means
    the same under every layout. A pipeline stage is a copy that keeps some blocks and sets the parts it does not own
    to None; `forward` must accept a missing embedding (its input is then hidden states) and a missing head (its output
    is then hidden states), and an optional `kv_cache` (decoding)."""

    BLOCKS: ClassVar[str]  # the ModuleDict of blocks
    EMBEDDING: ClassVar[str]  # the token embedding (an nn.Embedding, `.weight` [vocab, d])
    HEAD: ClassVar[str]  # the output projection (an nn.Linear without bias, `.weight` [vocab, d])
    FIRST_STAGE: ClassVar[tuple[str, ...]]  # every top-level part only the first stage holds (EMBEDDING among them)
    LAST_STAGE: ClassVar[tuple[str, ...]]  # every top-level part only the last stage holds (HEAD among them)
    # a last stage's own copy of the embedding where it also embeds tokens (multi-token prediction) and the first
    # stage is another: kept equal to the embedding as a tied head's copy is (parallel/engine.py: tied_copies)
    EMBEDDING_COPY: ClassVar[str | None] = None

    cfg: Any

    @property
    def blocks(self) -> nn.ModuleDict:
        return getattr(self, self.BLOCKS)

    @property
    def embedding(self) -> nn.Module | None:
        return getattr(self, self.EMBEDDING)

    @property
    def head(self) -> nn.Module | None:
        return getattr(self, self.HEAD)

    @property
    def embedding_copy(self) -> nn.Module | None:
        return getattr(self, self.EMBEDDING_COPY, None) if self.EMBEDDING_COPY else None

    def shares_embedding(self) -> bool:
        """Whether the last stage uses the embedding's weight too (a tied head; multi-token prediction's inputs), so
        that its copies there and on the first stage must get the sum of their gradients."""
        return bool(self.cfg.tie_embeddings)

    def extra_blocks(self) -> list[nn.Module]:
        """Blocks outside the stack (`BLOCKS`) that the parallel plan applies to as to the stack's: a multi-token
        prediction module's transformer block."""
        return []

    def parallel_plan(self) -> ParallelPlan:
        raise NotImplementedError

    def run_blocks(self, x: torch.Tensor, kv_cache=None) -> torch.Tensor:
        """This stage's blocks in order. Decoding (`kv_cache`): each block appends its keys and values under its global
        index, and the cache advances by the new positions once all have."""
        for name, block in self.blocks.items():
            x = block(x) if kv_cache is None else block(x, kv_cache, int(name))
        if kv_cache is not None:
            kv_cache.length += x.shape[1]
        return x

    def stage(self, layers: range, first: bool, last: bool) -> CausalLM:
        """A copy that keeps only blocks `layers` and, unless `first`/`last`, none of the first/last stage's parts.
        Only what it keeps is copied: a deep copy is Python work per module even on the meta device, and copying the
        whole model for every stage was a third of a small pipelined run's set-up."""
        dropped = (() if first else self.FIRST_STAGE) + (() if last else self.LAST_STAGE)
        memo = {id(part): None for part in (getattr(self, name) for name in dropped) if part is not None}
        kept = nn.ModuleDict({str(i): self.blocks[str(i)] for i in layers})
        memo[id(self.blocks)] = copy.deepcopy(kept, memo)  # the same memo: a tensor shared with a kept part stays shared
        return copy.deepcopy(self, memo)

    def state_tables(self) -> dict[str, torch.Tensor]:
        """The tables that are state a run trains and a checkpoint keeps, though no parameter (a router's selection
        bias under loss-free balancing), by their name in the module; the submodules that hold one define
        `saved_tables`. Replicated on every rank that holds their module."""
        return {f"{prefix}.{k}": v for prefix, m in self.named_modules() if hasattr(m, "saved_tables")
                for k, v in m.saved_tables().items()}

    def init_tables(self, device: torch.device) -> None:
        """Fill the tables that are no parameters (rotary frequencies) on `device`, once the parameters are there: a
        module built on the meta device has none. They are plain attributes, not buffers, so that no cast of the module
        (DeepSpeed's bf16 engine, `.to(bfloat16)`) rounds them. The submodules that hold one define `init_tables`."""
        for m in self.modules():
            if m is not self and hasattr(m, "init_tables"):
                m.init_tables(device)


# ---- Hugging Face --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HFPart:
    """One Hugging Face tensor that a canonical tensor is made of: `rows` of it along dim 0 (None: the whole tensor,
    its only part), in order, stored transposed (GPT-2's Conv1D weights) or not. `expert`: the part is expert
    `expert`'s slice of a stacked expert weight (canonical [E, ...], the HF tensor [...]: transformers keeps experts
    fused in memory and one tensor per expert on disk); its `rows` then stack along dim 1, within the expert."""

    name: str
    rows: int | None = None
    transposed: bool = False
    expert: int | None = None

    def origin(self, row: int, ndim: int) -> tuple[int, ...]:
        """Where the part starts in the canonical tensor, `row` rows into its block (its expert's, or the tensor's)."""
        return (row,) + (0,) * (ndim - 1) if self.expert is None else (self.expert, row) + (0,) * (ndim - 2)


class HFAdapter:
    """A family's mapping to and from a Hugging Face `save_pretrained` directory. Canonical names are trainer3d's
    parameter names (the tied head stored once, as the embedding); HF names are what the directory's files hold.
    A family declares, per canonical tensor, the HF tensors it is made of (`parts`: stacked along dim 0, each maybe
    transposed); conversion both ways and the reading of any block of a canonical tensor follow from that."""

    model_types: tuple[str, ...]  # the config.json model_types it reads
    architecture: str  # the transformers class that loads an export, e.g. "LlamaForCausalLM"

    def config_from_hf(self, raw: dict, dropout: float | None) -> Any:
        """The family's config from config.json's dict; ValueError naming what it cannot represent."""
        raise NotImplementedError

    def hf_config(self, cfg, dtype: torch.dtype | None, eos_token_id: int | list[int] | None,
                  bos_token_id: int | None):
        """The transformers config object for `cfg` (its `to_json_file` writes config.json); `eos_token_id` may list
        every id that ends a reply (an end of turn and the eos)."""
        raise NotImplementedError

    def parts(self, cfg, name: str) -> list[HFPart]:
        raise NotImplementedError

    def sources(self, cfg, name: str) -> list[str]:
        return [p.name for p in self.parts(cfg, name)]

    def experts_module(self, cfg, name: str) -> str:
        """The module of transformers' model in memory that holds the mixture of experts `name` (ours, e.g.
        `layers.3.mlp.experts`) as stacked weights named as Experts.STACKED: what PEFT's target_parameters and adapter
        keys name. (A checkpoint's files hold the experts one by one under other names: `parts`.)"""
        raise NotImplementedError(f"{type(self).__name__} has no mixture of experts")

    def from_hf(self, cfg, name: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        parts = self.parts(cfg, name)
        tensors = [t.t() if p.transposed else t for p, t in zip(parts, tensors)]
        if parts[0].expert is not None:  # per-expert tensors: stacked along a new dim 0, rows within each expert
            by_expert: dict[int, list[torch.Tensor]] = {}
            for p, t in zip(parts, tensors):
                by_expert.setdefault(p.expert, []).append(t)
            return torch.stack([torch.cat(by_expert[e], dim=0) for e in sorted(by_expert)])
        return torch.cat(tensors, dim=0) if len(tensors) > 1 else tensors[0].contiguous()

    def to_hf(self, cfg, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        parts = self.parts(cfg, name)
        if parts[0].expert is not None:
            return {k: v for e in sorted({p.expert for p in parts}) for k, v in
                    self.expert_to_hf(cfg, name, e, tensor[e]).items()}
        return self._rows_to_hf(parts, tensor)

    def expert_to_hf(self, cfg, name: str, expert: int, block: torch.Tensor) -> dict[str, torch.Tensor]:
        """Expert `expert`'s HF tensors from its block of a stacked expert weight (canonical[expert])."""
        return self._rows_to_hf([p for p in self.parts(cfg, name) if p.expert == expert], block)

    @staticmethod
    def _rows_to_hf(parts: list[HFPart], block: torch.Tensor) -> dict[str, torch.Tensor]:
        out, start = {}, 0
        for p in parts:
            rows = p.rows if p.rows is not None else block.shape[0] - start
            chunk = block.narrow(0, start, rows)
            start += rows
            out[p.name] = chunk.t() if p.transposed else chunk
        return out

    def import_notes(self, raw: dict) -> list[str]:
        """One-line notes on what reading config.json's dict leaves out, for the run's log."""
        return []

    def fit_to_weights(self, cfg, names: Callable[[], set[str]]) -> tuple[Any, list[str]]:
        """The config as far as the files hold its weights (`names()`: every HF tensor name in them), with a note
        on what it drops: DeepSeek-V3's MTP modules, which transformers' own saves declare and leave out."""
        return cfg, []

    def table_name(self, cfg, name: str) -> str | None:
        """The Hugging Face name of a model table (CausalLM.state_tables: a router's selection bias), or None where
        the family's format has no slot for it (such a table is neither imported nor exported)."""
        return None

    def normalize(self, hf_name: str) -> str:
        """A stored name as `sources` spells it (older files name some tensors differently; a multimodal model nests
        the language model's)."""
        return hf_name

    def passthrough(self, hf_name: str) -> bool:
        """Tensors of the directory that are no part of the language model trainer3d trains and that an export of a
        run started from it copies unchanged (a vision tower, a multi-token-prediction module transformers does not
        run): checkpoint/hf_source.py."""
        return False

    def export_layout(self, raw: dict, hf_config) -> tuple[dict, Callable[[str], str]] | None:
        """Where the directory a run started from (config.json's dict `raw`) wraps the language model in another
        architecture (a multimodal model): the config.json of its export, the language model's part being
        `hf_config` (this adapter's), and the stored name of each of our HF names. None: the export is ours."""
        return None

    def ignored(self, cfg, hf_name: str) -> bool:
        """HF tensors that are no parameter of ours (old buffers; a tied head's duplicate, checked by `check_extra`)."""
        return False

    def check_extra(self, cfg, hf_name: str, tensor: torch.Tensor, canonical: Callable[[str], torch.Tensor]) -> None:
        """Called for each `ignored` tensor with a reader of canonical tensors; raise ValueError if it contradicts them."""


# ---- the family ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelFamily:
    name: str
    config_cls: type
    model_cls: type  # a CausalLM subclass built from one config
    presets: Mapping[str, Any]
    init_value: Callable[[Any, str, tuple, int], torch.Tensor]  # (cfg, canonical name, full shape, seed)
    check: Callable[[Any, int], None]  # (cfg, tp): a shape the model or tp cannot take -> one sentence (ConfigError)
    hf: HFAdapter
    # (cfg, tp, cp): a context-parallel split the model cannot take -> one sentence (LayoutError); None: any
    check_cp: Callable[[Any, int, int], None] | None = None

    def build(self, cfg) -> CausalLM:
        return self.model_cls(cfg)


def canonical_name(model_cls: type, cfg, name: str) -> str:
    """The layout-free name of a parameter: a tied head's weight, and a last stage's copy of the embedding, are the
    embedding's."""
    head, embedding = f"{model_cls.HEAD}.weight", f"{model_cls.EMBEDDING}.weight"
    if model_cls.EMBEDDING_COPY and name == f"{model_cls.EMBEDDING_COPY}.weight":
        return embedding
    return embedding if name == head and cfg.tie_embeddings else name


def shape_fields(cfg) -> tuple[str, ...]:
    """The config fields that make two models' weights interchangeable (everything but the dropout rate)."""
    return tuple(f.name for f in dataclasses.fields(cfg) if f.name != "dropout")
