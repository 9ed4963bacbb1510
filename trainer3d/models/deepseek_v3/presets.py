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
    # DeepSeek-V3 / V3.1 (deepseek-ai/DeepSeek-V3 config.json): 671B total, 37B activated, one MTP module (14B)
    "deepseek-v3": DeepseekV3Config(**_MLA, mtp_layers=1),
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
