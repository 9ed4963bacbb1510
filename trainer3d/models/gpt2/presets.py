"""The gpt2 family's presets: the published sizes, each from its config.json or paper, and tiny ones for tests."""

from __future__ import annotations

from trainer3d.models.gpt2.config import GPTConfig


# The published GPT-2 family (Radford et al. 2019), a tiny one for CPU runs and tests, and the GPT-3 family.
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_positions=256, n_embd=128, n_layer=4, n_head=4),
    "gpt2": GPTConfig(n_embd=768, n_layer=12, n_head=12),
    "gpt2-medium": GPTConfig(n_embd=1024, n_layer=24, n_head=16),
    "gpt2-large": GPTConfig(n_embd=1280, n_layer=36, n_head=20),
    "gpt2-xl": GPTConfig(n_embd=1600, n_layer=48, n_head=25),
    # GPT-3 (Brown et al. 2020, Table 2.1), context 2048. Where the paper's heads do not divide d_model we keep its
    # d_head of 128 and choose the heads: 1.3B has 16 (paper: 24 heads of 128 on d_model 2048), 13B d_model 5120
    # (paper: 5140, not a multiple of its 40 heads).
    "gpt3-125m": GPTConfig(n_positions=2048, n_embd=768, n_layer=12, n_head=12),
    "gpt3-350m": GPTConfig(n_positions=2048, n_embd=1024, n_layer=24, n_head=16),
    "gpt3-760m": GPTConfig(n_positions=2048, n_embd=1536, n_layer=24, n_head=16),
    "gpt3-1.3b": GPTConfig(n_positions=2048, n_embd=2048, n_layer=24, n_head=16),
    "gpt3-2.7b": GPTConfig(n_positions=2048, n_embd=2560, n_layer=32, n_head=32),
    "gpt3-6.7b": GPTConfig(n_positions=2048, n_embd=4096, n_layer=32, n_head=32),
    "gpt3-13b": GPTConfig(n_positions=2048, n_embd=5120, n_layer=40, n_head=40),
    "gpt3-175b": GPTConfig(n_positions=2048, n_embd=12288, n_layer=96, n_head=96),
    # Megatron-LM's 1T model (Narayanan et al. 2021, Table 1)
    "megatron-1t": GPTConfig(n_positions=2048, n_embd=25600, n_layer=128, n_head=160),
}
