"""The deepseek_v3 family's presets: the published sizes, each from its config.json or paper, and tiny ones for tests."""

from __future__ import annotations

from trainer3d.models.deepseek_v3.config import DeepseekV3Config


_MLA = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
PRESETS: dict[str, DeepseekV3Config] = {
    # CPU runs and tests: every part (q and kv latents, YaRN with its mscale, interleaved rope, v_head_dim != the qk
    # dims, two dense blocks, 8 experts in 4 groups with top-2 from 2 groups, a shared expert, one MTP module)
    "deepseek-v3-tiny": DeepseekV3Config(
        vocab_size=129280, n_positions=4096, n_embd=128, n_layer=4, n_head=4, ffn_hidden=256, q_lora_rank=64,
        kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24, n_experts=8, n_shared_experts=1,
        top_k=2, moe_ffn_hidden=48, n_group=4, topk_group=2, first_k_dense_replace=2, rope_factor=4.0,
        rope_original_context=1024, mtp_layers=1),
    # ... with DeepSeek Sparse Attention: 4 indexer heads of 16 dims choosing 64 keys
    "deepseek-v3.2-tiny": DeepseekV3Config(
        vocab_size=129280, n_positions=4096, n_embd=128, n_layer=4, n_head=4, ffn_hidden=256, q_lora_rank=64,
        kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24, n_experts=8, n_shared_experts=1,
        top_k=2, moe_ffn_hidden=48, n_group=4, topk_group=2, first_k_dense_replace=2, rope_factor=4.0,
        rope_original_context=1024, mtp_layers=0, index_n_heads=4, index_head_dim=16, index_topk=64),
    # DeepSeek-V3 / V3.1 (deepseek-ai/DeepSeek-V3 config.json): 671B total, 37B activated, one MTP module (14B)
    "deepseek-v3": DeepseekV3Config(**_MLA, mtp_layers=1),
    # DeepSeek-V3.2 (transformers' DeepseekV32Config, which documents deepseek-ai/DeepSeek-V3.2-Exp): V3's shape with
    # an indexer in every layer (64 heads of 128, top 2048 keys): 0.87B more parameters than V3, the MTP module's
    # indexer included
    "deepseek-v3.2": DeepseekV3Config(**_MLA, mtp_layers=1, index_n_heads=64, index_head_dim=128, index_topk=2048),
    # GLM-5 (zai-org/GLM-5, as transformers' GlmMoeDsaConfig documents it): 78 blocks, wider heads (192 + 64 qk, 256
    # v), no expert groups, an indexer of 32 heads in every layer with interleaved rope
    "glm-5": DeepseekV3Config(
        vocab_size=154880, n_positions=202752, n_embd=6144, n_layer=78, n_head=64, ffn_hidden=12288,
        q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, n_group=1,
        topk_group=1, norm_eps=1e-5, rope_factor=None, index_n_heads=32, index_head_dim=128, index_topk=2048,
        index_rope_interleave=True),
    # Kimi K2 (moonshotai/Kimi-K2-Instruct config.json, 128K context): 1T total (its report: 1.04T), 32B activated
    "kimi-k2": DeepseekV3Config(**_MLA, vocab_size=163840, n_positions=131072, n_head=64, n_experts=384, n_group=1,
                                topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.827, rope_theta=50000.0,
                                rope_factor=32.0, rope_beta_fast=1.0, rope_beta_slow=1.0),
    # Moonlight-16B-A3B (moonshotai/Moonlight-16B-A3B config.json): no q latent, no YaRN
    "moonlight-16b-a3b": DeepseekV3Config(
        **_MLA, vocab_size=163840, n_positions=8192, n_embd=2048, n_layer=27, n_head=16, ffn_hidden=11264,
        q_lora_rank=None, n_experts=64, n_shared_experts=2, top_k=6, moe_ffn_hidden=1408, n_group=1, topk_group=1,
        first_k_dense_replace=1, routed_scaling_factor=2.446, norm_eps=1e-5, rope_theta=50000.0, rope_factor=None),
}
