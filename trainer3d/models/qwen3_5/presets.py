"""The qwen3_5 family's presets: the published Qwen3.5 sizes from their config.json files' text_config (Qwen/Qwen3.5-*
on the Hugging Face hub; read 2026-12 through copies quoted in Megatron-Bridge, slime and aiconfigurator), and tiny
ones for tests. Shared by all: vocabulary 248320, head_dim 256, 16 linear key heads of 128 dims, value heads of 128,
conv kernel 4, a full-attention block every 4th, rope theta 1e7 on a quarter of each head, eps 1e-6."""

from __future__ import annotations

from trainer3d.models.qwen3_5.config import Qwen35Config

_SHARED = dict(vocab_size=248320, n_positions=262144, rope_theta=10000000.0, rope_factor=None, norm_eps=1e-6,
               explicit_head_dim=256, partial_rotary_factor=0.25, full_attention_interval=4, linear_conv_kernel=4,
               linear_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128)
# tests: every part at a size two cores train: key heads != value heads, a head_dim != d/heads, an 8-layer stack
# (blocks 3 and 7 full attention), conv kernel 4
_TINY = dict(_SHARED, vocab_size=248320, explicit_head_dim=32, linear_key_heads=2, linear_value_heads=4,
             linear_key_head_dim=16, linear_value_head_dim=24, n_embd=96, n_head=4, n_kv_heads=2)
PRESETS: dict[str, Qwen35Config] = {
    "qwen3.5-tiny": Qwen35Config(**_TINY, n_layer=8, ffn_hidden=256, tie_embeddings=True),
    "qwen3.5-moe-tiny": Qwen35Config(**_TINY, n_layer=4, ffn_hidden=256, n_experts=8, top_k=2, moe_ffn_hidden=64,
                                     shared_expert_hidden=64),
    "qwen3.5-0.8b": Qwen35Config(**_SHARED, n_embd=1024, n_layer=24, n_head=8, n_kv_heads=2, ffn_hidden=3584,
                                 linear_value_heads=16, tie_embeddings=True),
    "qwen3.5-4b": Qwen35Config(**_SHARED, n_embd=2560, n_layer=32, n_head=16, n_kv_heads=4, ffn_hidden=9216,
                               linear_value_heads=32, tie_embeddings=True),
    "qwen3.5-9b": Qwen35Config(**_SHARED, n_embd=4096, n_layer=32, n_head=16, n_kv_heads=4, ffn_hidden=12288,
                               linear_value_heads=32),
    "qwen3.5-27b": Qwen35Config(**_SHARED, n_embd=5120, n_layer=64, n_head=24, n_kv_heads=4, ffn_hidden=17408,
                                linear_value_heads=48),
    "qwen3.5-35b-a3b": Qwen35Config(**_SHARED, n_embd=2048, n_layer=40, n_head=16, n_kv_heads=2, ffn_hidden=512,
                                    linear_value_heads=32, n_experts=256, top_k=8, moe_ffn_hidden=512,
                                    shared_expert_hidden=512),
    "qwen3.5-122b-a10b": Qwen35Config(**_SHARED, n_embd=3072, n_layer=48, n_head=32, n_kv_heads=2, ffn_hidden=1024,
                                      linear_value_heads=64, n_experts=256, top_k=8, moe_ffn_hidden=1024,
                                      shared_expert_hidden=1024),
    "qwen3.5-397b-a17b": Qwen35Config(**_SHARED, n_embd=4096, n_layer=60, n_head=32, n_kv_heads=2, ffn_hidden=1024,
                                      linear_value_heads=64, n_experts=512, top_k=10, moe_ffn_hidden=1024,
                                      shared_expert_hidden=1024),
}
