"""DeepSeek-V3's shape and formulas (Kimi K2 and Moonlight share it: transformers loads all three as
DeepseekV3ForCausalLM): multi-head latent attention (MLA) with decoupled rotary keys and YaRN, `first_k_dense_replace`
dense blocks, then mixtures of experts with shared experts and DeepSeek's routing, and `mtp_layers` multi-token
prediction modules (mtp.py). Published sizes from the Hugging Face config.json files, plus a tiny one for CPU runs.

`num_params` counts what the model builds, the MTP modules included (`mtp_params`); the published counts (671B for
DeepSeek-V3) leave them out (the paper's 14B more). The FLOPs of a step count them too (they train with the model)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from trainer3d.models.interface import LayerActivations
from trainer3d.models.llama.config import LlamaConfig
from trainer3d.models.moe import MoESpec

LATENT_NORM_EPS = 1e-6  # transformers builds MLA's two latent RMSNorms with their default eps, not rms_norm_eps


@dataclass(frozen=True)
class DeepseekV3Config:
    vocab_size: int = 129280
    n_positions: int = 163840
    n_embd: int = 7168
    n_layer: int = 61
    n_head: int = 128
    dropout: float = 0.0  # on the attention probabilities (HF's attention_dropout)
    ffn_hidden: int = 18432  # the dense blocks' SwiGLU width (HF's intermediate_size)
    # MLA: q = q_b(norm(q_a(x))) (q_lora_rank None: one q_proj); [latent, k_rope] = kv_a(x); k_nope | v = kv_b(norm(latent))
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # the mixtures of experts (blocks first_k_dense_replace and after)
    n_experts: int = 256  # routed experts (HF's n_routed_experts)
    n_shared_experts: int = 1
    top_k: int = 8
    moe_ffn_hidden: int = 2048
    n_group: int = 8
    topk_group: int = 4
    first_k_dense_replace: int = 3
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    norm_eps: float = 1e-6
    # rotary positions on the qk_rope_head_dim dims; rope_factor set: YaRN (HF's rope_type "yarn")
    rope_theta: float = 10000.0
    rope_interleave: bool = True
    rope_factor: float | None = 40.0
    rope_original_context: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 1.0  # 0: not given
    rope_mscale_all_dim: float = 1.0  # 0: not given
    rope_attention_factor: float | None = None  # None: from the factor and the mscales, as transformers derives it
    rope_truncate: bool = True
    tie_embeddings: bool = False
    # multi-token prediction (DeepSeek-V3 §2.2): D modules after the last block, each a block of the last's kind
    # (HF's num_nextn_predict_layers); module k is layer n_layer + k - 1 of DeepSeek's files
    mtp_layers: int = 0
    # DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5; indexer.py): each MLA layer's lightning indexer scores the
    # earlier tokens with index_n_heads heads of index_head_dim and the query attends to its index_topk best (0 heads:
    # dense MLA). GLM-5 rotates the indexer's rope dims in interleaved pairs; its "shared" layers (index_shared[i])
    # reuse the selection of the nearest earlier layer with an indexer.
    index_n_heads: int = 0
    index_head_dim: int = 128
    index_topk: int = 2048
    index_rope_interleave: bool = False
    index_shared: tuple[bool, ...] = ()

    family: ClassVar[str] = "deepseek_v3"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_width(self) -> int:
        """Keys (or values) of a token over the heads as attention holds them: every head's key is qk_head_dim wide
        (its rope part shared), and values are padded to that width for the attention kernels (model.py)."""
        return self.n_head * self.qk_head_dim

    def cp_gather_width(self, tp: int, sequence_parallel: bool) -> int:
        """Numbers a token's keys take on context parallelism's all-gather, per block: the latent and the rope key
        (model.py), which each rank expands itself; under sequence parallelism the expanded keys and values of this
        rank's heads (kv_b gathers its input over tp first)."""
        index = self.index_head_dim if self.sparse else 0  # (DSA: its indexer's keys travel too)
        return (2 * self.kv_width // tp if sequence_parallel else self.kv_lora_rank + self.qk_rope_head_dim) + index

    def sp_whole_sequence_width(self, layer: int) -> int:
        """Numbers a token takes on sequence parallelism's all-gather into block `layer`'s whole-sequence entry
        (model.py's index_inputs: x and the q latent, its indexer's detached inputs); 0 without an indexer."""
        return self.n_embd + self.q_lora_rank if self.has_indexer(layer) else 0

    @property
    def sparse(self) -> bool:
        """DeepSeek Sparse Attention: the layers carry a lightning indexer (indexer.py)."""
        return self.index_n_heads > 0

    def has_indexer(self, layer: int) -> bool:
        """Does block `layer` (an MTP module's index included) run an indexer of its own? (GLM-5's shared ones not.)"""
        return self.sparse and not (layer < len(self.index_shared) and self.index_shared[layer])

    @property
    def n_indexers(self) -> int:
        return sum(map(self.has_indexer, range(self.n_layer + self.mtp_layers)))

    def indexer_params(self) -> int:
        """One indexer's parameters: wq_b from the q latent, the key wk, its LayerNorm and the head weights."""
        n, hd, d = self.index_n_heads, self.index_head_dim, self.n_embd
        return (self.q_lora_rank or 0) * n * hd + d * hd + 2 * hd + d * n if self.sparse else 0

    def keys_attended(self, seq_len: int) -> int:
        """The keys a query's attention reads in the FLOPs' convention (every position's T): its top-k under DSA."""
        return min(seq_len, self.index_topk) if self.sparse else seq_len

    @property
    def moe(self) -> MoESpec:
        return MoESpec(self.n_experts, self.top_k, self.moe_ffn_hidden, score="sigmoid", renormalize=self.norm_topk_prob,
                       weights_fp32=True, shared_hidden=self.moe_ffn_hidden * self.n_shared_experts,
                       n_groups=self.n_group, top_groups=self.topk_group, scale=self.routed_scaling_factor,
                       renorm_eps=1e-20)

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def moe_layers(self) -> list[int]:
        """Every MoE block's global index, the MTP modules' (n_layer, n_layer + 1, ...) included: the routing
        statistics and loss-free balancing see them as layers (parallel/moe_balance.py)."""
        return [i for i in range(self.n_layer + self.mtp_layers) if self.is_moe_layer(i)]

    # ---- formulas: parameters and FLOPs per block (an MoE block counts all its experts, or the k a token uses) ----
    def attention_params(self) -> int:
        d, H, qk = self.n_embd, self.n_head, self.qk_head_dim
        q = d * H * qk if self.q_lora_rank is None else self.q_lora_rank * (d + 1 + H * qk)
        kv = d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * (1 + H * (self.qk_nope_head_dim
                                                                                            + self.v_head_dim))
        return q + kv + H * self.v_head_dim * d + self.indexer_params()

    def attention_norm_params(self) -> int:
        """The gains inside attention (no matmul): the two latent RMSNorms' and the indexer's LayerNorm."""
        return self.kv_lora_rank + (self.q_lora_rank or 0) + (2 * self.index_head_dim if self.sparse else 0)

    # an MoE block's parameters and the model's total: Llama's formulas over this config's attention_params
    mlp_params = LlamaConfig.mlp_params

    def block_params(self, layer: int | None = None, active: bool = False) -> int:
        """Llama's count over this config's attention (an indexer included), less the indexer a shared layer lacks."""
        n = LlamaConfig.block_params(self, layer, active)
        return n if layer is None or self.has_indexer(layer) else n - self.indexer_params()

    def num_params(self, include_embedding: bool = True, active: bool = False) -> int:
        return LlamaConfig.num_params(self, include_embedding, active) + self.mtp_params(active)

    def mtp_params(self, active: bool = False) -> int:
        """The MTP modules' own parameters (each a block, eh_proj [d, 2d] and three norms: enorm, hnorm and its
        final norm); the embedding and the head are the model's."""
        d = self.n_embd
        return sum(self.block_params(self.n_layer + k, active) + 2 * d * d + 3 * d for k in range(self.mtp_layers))

    def _mtp_matmul_params(self) -> float:
        """A token's matmul parameters in the MTP modules: each one's block and eh_proj, and the head it applies."""
        norms = 2 * self.n_embd + self.attention_norm_params()
        return sum(self.block_params(self.n_layer + k, active=True) - norms + 2 * self.n_embd ** 2
                   + self.vocab_size * self.n_embd for k in range(self.mtp_layers))

    def _matmul_params(self) -> float:
        """A token's matmul parameters per block, averaged over the blocks (norm gains excluded)."""
        return self.block_params(active=True) - 2 * self.n_embd - self.attention_norm_params()

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 per matmul parameter a token uses (the head included, the embedding lookup
        excluded; an MoE layer's router and its k experts and shared experts) plus attention's QK^T over
        qk_head_dim and AV over v_head_dim for every head, 6·L·H·(qk + v)·T (Llama's 12·L·H·hd·T with MLA's two
        widths; DSA: T the top-k keys, and its indexers' scores over every key)."""
        matmul = self.n_layer * self._matmul_params() + self.vocab_size * self.n_embd + self._mtp_matmul_params()
        blocks = self.n_layer + self.mtp_layers
        attention = self.n_head * (self.qk_head_dim + self.v_head_dim) * self.keys_attended(seq_len)
        return 6.0 * matmul + 6.0 * blocks * attention + (
            6.0 * self.n_indexers * self.index_n_heads * self.index_head_dim * seq_len)

    def layer_flops(self, seq_len: int) -> float:
        """A block's forward FLOPs per token: its matmuls, attention over the keys it reads (DSA: its top-k) and, with
        DSA, the indexer's scores over every earlier key (the mean over the blocks, shared ones without)."""
        index = 2 * self.index_n_heads * self.index_head_dim * seq_len * (
            sum(map(self.has_indexer, range(self.n_layer))) / self.n_layer)
        attention = self.n_head * (self.qk_head_dim + self.v_head_dim) * self.keys_attended(seq_len)
        return 2 * self._matmul_params() + 2 * attention + index

    def head_flops(self) -> float:
        """The head's forward FLOPs per token and, on the same (last) stage, the MTP modules' matmuls (their
        attention's share, which grows with the sequence, left out: the pipeline's balance is coarse anyway)."""
        return 2 * self.n_embd * self.vocab_size + 2 * self._mtp_matmul_params()

    def layer_activations(self) -> LayerActivations:
        """Elements one block saves for its backward, per token, in Llama's accounting for the block's norms and its
        MLP (a dense SwiGLU, or an MoE block's router, k copies through the experts and the shared experts: the
        group-limited selection keeps nothing, its graph ends in indices), with MLA's attention as its saved tensors
        measure (tests/test_deepseek_v3.py). Replicated over tp: kv_a's own copy of the block norm's output in the
        matmul dtype (q_a has Llama's), each latent norm's fp32 copy of its input, its statistics, its output before
        the gain and q_b's (kv_b's) input, and the rotary cos and sin. Split by head: the query, key and output of the
        attention kernel (qk_head_dim wide each), its values (padded to qk_head_dim; where v_head_dim is qk_head_dim
        already, a view of kv_b's output, which is kept whole), o_proj's input (v_head_dim wide) and the log-sum-exp.
        DSA, per (query, key) pair of a sparse layer: the attention's mask in the matmul dtype (the kernel's additive
        form) and, where the layer has its own indexer, its loss's gradient direction (fp32) and its scores' visible
        mask (bool): 7 bytes a pair in bf16 (tests/test_dsa.py measures them)."""
        h, H, qk = self.n_embd, self.n_head, self.qk_head_dim
        q, kv = self.q_lora_rank or 0, self.kv_lora_rank
        values = qk if self.v_head_dim != qk else self.qk_nope_head_dim + self.v_head_dim
        spec, share = self.moe, sum(map(self.is_moe_layer, range(self.n_layer))) / self.n_layer
        k = spec.top_k
        mlp = 4 * self.ffn_hidden * (1 - share) + share * k * (2 * h + 2 * spec.expert_hidden + 1)
        mlp += share * (h + 4 * spec.shared_hidden) if spec.shared_hidden else 0
        moe_fp32 = share * (h + spec.n_experts + 1 + 9 * k)
        return LayerActivations(
            resid=2 * h, matmul=round(3 * h - share * h + 2 * q + 2 * kv + 2 * self.qk_rope_head_dim),
            sharded_matmul=round(H * (3 * qk + values + self.v_head_dim) + mlp), fp32=2 + q + kv + (2 if q else 1),
            sharded_fp32=round(H + moe_fp32), pair_matmul=1.0 if self.sparse else 0.0,
            pair_bytes=5 * sum(map(self.has_indexer, range(self.n_layer))) / self.n_layer)
