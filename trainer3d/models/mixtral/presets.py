"""The mixtral family's presets: the published sizes, each from its config.json or paper, and tiny ones for tests."""

from __future__ import annotations

from trainer3d.models.mixtral.config import MixtralConfig


_SHARED = dict(rope_theta=1000000.0, rope_factor=None, norm_eps=1e-5)
PRESETS: dict[str, MixtralConfig] = {
    "mixtral-tiny": MixtralConfig(**_SHARED, vocab_size=32000, n_positions=32768, n_embd=128, n_layer=4, n_head=4,
                                  n_kv_heads=2, ffn_hidden=96, n_experts=4, top_k=2),
    "mixtral-8x7b": MixtralConfig(**_SHARED, vocab_size=32000, n_positions=32768, n_embd=4096, n_layer=32, n_head=32,
                                  n_kv_heads=8, ffn_hidden=14336),
    "mixtral-8x22b": MixtralConfig(**_SHARED, vocab_size=32768, n_positions=65536, n_embd=6144, n_layer=56, n_head=48,
                                   n_kv_heads=8, ffn_hidden=16384),
}
