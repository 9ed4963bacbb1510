"""The qwen3 family's presets: the published sizes, each from its config.json or paper, and tiny ones for tests."""

from __future__ import annotations

from trainer3d.models.qwen3.config import Qwen3Config


_SHARED = dict(vocab_size=151936, n_positions=40960, rope_theta=1000000.0, rope_factor=None, norm_eps=1e-6,
               explicit_head_dim=128)
PRESETS: dict[str, Qwen3Config] = {
    # CPU runs and tests: q/k norms with head_dim != d/heads; the MoE one with a dense first block (mlp_only_layers)
    "qwen3-tiny": Qwen3Config(**{**_SHARED, "explicit_head_dim": 48}, n_embd=128, n_layer=4, n_head=4, n_kv_heads=2,
                              ffn_hidden=384, tie_embeddings=True),
    "qwen3-moe-tiny": Qwen3Config(**{**_SHARED, "explicit_head_dim": 48}, n_embd=128, n_layer=4, n_head=4,
                                  n_kv_heads=2, ffn_hidden=384, n_experts=8, top_k=2, moe_ffn_hidden=96,
                                  mlp_only_layers=(0,)),
    "qwen3-0.6b": Qwen3Config(**_SHARED, n_embd=1024, n_layer=28, n_head=16, n_kv_heads=8, ffn_hidden=3072,
                              tie_embeddings=True),
    "qwen3-8b": Qwen3Config(**_SHARED, n_embd=4096, n_layer=36, n_head=32, n_kv_heads=8, ffn_hidden=12288),
    "qwen3-30b-a3b": Qwen3Config(**_SHARED, n_embd=2048, n_layer=48, n_head=32, n_kv_heads=4, ffn_hidden=6144,
                                 n_experts=128, top_k=8, moe_ffn_hidden=768),
    "qwen3-235b-a22b": Qwen3Config(**_SHARED, n_embd=4096, n_layer=94, n_head=64, n_kv_heads=4, ffn_hidden=12288,
                                   n_experts=128, top_k=8, moe_ffn_hidden=1536),
}
