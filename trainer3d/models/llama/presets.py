"""The llama family's presets: the published sizes, each from its config.json or paper, and tiny ones for tests."""

from __future__ import annotations

from trainer3d.models.llama.config import LlamaConfig


_SHARED = dict(vocab_size=128256, n_positions=131072, rope_theta=500000.0, norm_eps=1e-5)
PRESETS: dict[str, LlamaConfig] = {
    # CPU runs and tests: every part of the 3.1 shape (GQA, llama3 rope scaling) at a size two cores train
    "llama-tiny": LlamaConfig(**_SHARED, n_embd=128, n_layer=4, n_head=4, n_kv_heads=2, ffn_hidden=384),
    "llama3.2-1b": LlamaConfig(**_SHARED, n_embd=2048, n_layer=16, n_head=32, n_kv_heads=8, ffn_hidden=8192,
                               rope_factor=32.0, tie_embeddings=True),
    "llama3.2-3b": LlamaConfig(**_SHARED, n_embd=3072, n_layer=28, n_head=24, n_kv_heads=8, ffn_hidden=8192,
                               rope_factor=32.0, tie_embeddings=True),
    "llama3.1-8b": LlamaConfig(**_SHARED, n_embd=4096, n_layer=32, n_head=32, n_kv_heads=8, ffn_hidden=14336),
    "llama3.1-70b": LlamaConfig(**_SHARED, n_embd=8192, n_layer=80, n_head=64, n_kv_heads=8, ffn_hidden=28672),
    "llama3.1-405b": LlamaConfig(**_SHARED, n_embd=16384, n_layer=126, n_head=128, n_kv_heads=8, ffn_hidden=53248),
}
