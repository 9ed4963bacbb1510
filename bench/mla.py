"""One multi-head latent attention (MLA) layer on CPU, fp32: trainer3d's `MLAttention` against transformers'
`DeepseekV3Attention` (its `sdpa` and `eager` attention), forward and backward, at DeepSeek-V3's MLA scaled to a CPU
(hidden 1024, 8 heads of 64 nope + 32 rope dims and 64 value dims, q latent 384, kv latent 128, YaRN factor 4, 2048
tokens). Time: all sides in one process, rotated each round, the median of per-round ratios to trainer3d's. Memory:
each side in its own process, the malloc peak of three passes (bench/memhook.c) and the resident-set high-water mark
read from outside (/proc/<pid>/status VmHWM). Decoding: the KV cache's bytes a token and layer, trainer3d's latent
cache against transformers' cache of k and v, at DeepSeek-V3's full shape; and the time a new token takes through one
layer after a short and a long prompt, the latent absorbed into the query (trainer3d's decoding) against the latent
expanded through kv_b at every token (its decoding until 2026-12-07).

    python bench/mla.py --rounds 8
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from bench.harness import fmt_bytes, print_malloc_peak, stamp, table, time_rotated  # noqa: E402
from bench.measure import run_under_memhook  # noqa: E402

SHAPE = dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=384, kv_lora_rank=128, qk_nope_head_dim=64,
             qk_rope_head_dim=32, v_head_dim=64)
TOKENS = 2048
ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}


def _hf_config(implementation: str):
    import transformers

    cfg = transformers.DeepseekV3Config(**SHAPE, num_hidden_layers=1, max_position_embeddings=4 * TOKENS,
                                        rope_parameters=ROPE, vocab_size=1024)
    cfg._attn_implementation = implementation
    return cfg


def _hf_side(implementation: str):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    cfg = _hf_config(implementation)
    attn, rotary = DeepseekV3Attention(cfg, layer_idx=0), DeepseekV3RotaryEmbedding(cfg)
    positions = torch.arange(TOKENS)[None]

    def forward(x):
        mask = None if implementation == "sdpa" else torch.full((TOKENS, TOKENS), float("-inf")).triu(1)[None, None]
        return attn(x, rotary(x, positions), mask)[0]  # sdpa: causal from the missing mask; eager: the mask given

    return attn, forward


def _ours_side():
    from trainer3d.models.deepseek_v3.hf import DeepseekV3Adapter
    from trainer3d.models.deepseek_v3.model import MLAttention

    raw = _hf_config("sdpa").to_dict()
    cfg = DeepseekV3Adapter().config_from_hf(raw, dropout=0.0)
    attn = MLAttention(cfg)
    attn.rotary.init_tables(torch.device("cpu"))
    return attn, attn


SIDES = {"trainer3d MLAttention": _ours_side, "transformers sdpa": lambda: _hf_side("sdpa"),
         "transformers eager": lambda: _hf_side("eager")}


def _pass_of(make):
    module, forward = make()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    x = torch.randn(1, TOKENS, SHAPE["hidden_size"], requires_grad=True)
    target = torch.randn(1, TOKENS, SHAPE["hidden_size"])

    def run():
        (forward(x) * target).sum().backward()
        module.zero_grad(set_to_none=True)
        x.grad = None

    return run


def time_sides(rounds: int) -> dict:
    torch.set_num_threads(1)
    return time_rotated({name: _pass_of(make) for name, make in SIDES.items()}, rounds, "trainer3d MLAttention")


def memory_child(side: str) -> None:
    torch.set_num_threads(1)
    print_malloc_peak(_pass_of(SIDES[side]))


def cache_bytes() -> list[list]:
    """Bytes a token and layer in bf16: trainer3d's cache (the normed kv latent and the rope key) against k and v of
    every head (transformers' DynamicCache holds the keys and values the attention made)."""
    from trainer3d.models import MODEL_PRESETS

    c = MODEL_PRESETS["deepseek-v3"]
    ours = (c.kv_lora_rank + c.qk_rope_head_dim) * 2
    theirs = c.n_head * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim) * 2
    per_seq = 128 * 1024 * c.n_layer  # a 128K-token sequence through all layers
    return [["trainer3d (latent + rope key)", ours, fmt_bytes(ours * per_seq), "1.0"],
            ["transformers (k and v)", theirs, fmt_bytes(theirs * per_seq), f"{theirs / ours:.1f}"]]


def _decoders(prompts: tuple[int, ...], rounds: int, per_round: int) -> dict:
    """(side, prompt) -> (layer, cache): one layer each, prefilled with the same prompt."""
    import torch.nn.functional as F

    from trainer3d.models.attention import KVCache
    from trainer3d.models.deepseek_v3.model import MLAttention

    class Expanded(MLAttention):
        """Decoding as it was until 2026-12-07: the cached latent expanded through kv_b_proj at every new token."""

        def _absorbed(self, q, latent, k_rope, allowed):
            latent_dim, nope, rope, v_dim = self.dims
            B, S = latent.shape[:2]
            k_nope, v = self.kv_b_proj(latent).view(B, S, -1, nope + v_dim).transpose(1, 2).split([nope, v_dim], -1)
            k = torch.cat((k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed.unsqueeze(1))

    out = {}
    for side, cls in (("latent expanded (before)", Expanded), ("absorbed (trainer3d)", MLAttention)):
        for prompt in prompts:
            layer = _ours_side()[0]
            layer.__class__ = cls
            torch.manual_seed(0)
            with torch.no_grad():
                for p in layer.parameters():
                    p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
                cache = KVCache(max_len=prompt + (rounds + 1) * per_round)
                layer(torch.randn(1, prompt, SHAPE["hidden_size"]), cache)
                cache.length = prompt
            out[side, prompt] = (layer, cache)
    return out


def decode_rows(rounds: int, prompts=(256, 4096), per_round: int = 8) -> list[list]:
    """ms per new token of one layer after prompts of two lengths: the median of rounds of `per_round` tokens, the
    four (side, prompt) pairs rotated each round (the first round warms up)."""
    import statistics
    import time

    from bench.harness import rotated

    torch.set_num_threads(1)
    runs = _decoders(prompts, rounds, per_round)
    times = {key: [] for key in runs}
    for r in range(rounds + 1):
        for key in rotated(list(runs), r):
            layer, cache = runs[key]
            with torch.no_grad():
                t0 = time.perf_counter()
                for _ in range(per_round):
                    layer(torch.randn(1, 1, SHAPE["hidden_size"]), cache)
                    cache.length += 1
                if r:
                    times[key].append((time.perf_counter() - t0) / per_round * 1e3)
    rows = []
    for side in dict.fromkeys(side for side, _ in runs):
        short, long = (statistics.median(times[side, p]) for p in prompts)
        rows.append([side, f"{short:.2f}", f"{long:.2f}", f"{long / short:.2f}"])
    return rows


def cp_rows() -> list[list]:
    """Context parallelism's bytes per step for the tiny DeepSeek-V3 (MLA, no MTP module) at cp 2, measured by
    bench/comm_volume.py's counter against the planner's count (plan/comm.py: the family's cp_gather_width): the
    latent and the rope key gathered, and under tp 2 with sequence parallelism the expanded keys and values of each
    rank's heads (the path every cp run took until 2026-12-07)."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from bench.comm_volume import compare, count_layouts
    from bench.harness import Case
    from helpers.distributed import run_world

    mla = dict(n_layer=4, n_embd=64, n_head=4, vocab=512, seq_len=32, global_batch=8)
    extra = {"model": "deepseek-v3-tiny", "mtp_layers": 0}
    cases = [Case(cp=2, extra=extra, **mla), Case(tp=2, cp=2, extra={**extra, "sequence_parallel": True}, **mla)]
    per_rank = run_world(4, count_layouts, cases, timeout=900)
    results = [[per_rank[r][i] for r in range(4)] for i in range(len(cases))]
    return [row[:1] + row[2:5] for row in compare(cases, results)[0] if row[1] == "cp"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return memory_child(args.child)
    t = time_sides(args.rounds)
    rows = []
    for side in SIDES:
        mem = run_under_memhook([sys.executable, os.path.abspath(__file__), "--child", side], ROOT)
        rows.append([side, f"{t[side][0] * 1e3:.0f}", f"{t[side][1]:.2f}", fmt_bytes(mem["peak"]),
                     fmt_bytes(mem["hwm"])])
    shape = ", ".join(f"{k} {v}" for k, v in SHAPE.items())
    print(f"One MLA layer ({shape}, {TOKENS} tokens, YaRN), forward + backward:\n")
    print(table(rows, ["side", "ms", "time / trainer3d", "malloc peak", "RSS high-water (outside)"]))
    print("\nKV cache of DeepSeek-V3 (61 layers, bf16), per token and layer, and for one 128K-token sequence:\n")
    print(table(cache_bytes(), ["cache", "bytes a token and layer", "a 128K sequence", "× trainer3d"]))
    print("\nContext parallelism's bytes per step, deepseek-v3-tiny (4 heads of 32 + 16 qk dims, a 32-wide latent), cp 2:\n")
    print(table(cp_rows(), ["cp layout", "cp bytes measured (all ranks)", "the planner's count", "ratio"]))
    print("\nDecoding one layer through the latent cache, ms per new token (the median of rounds of 8):\n")
    print(table(decode_rows(args.rounds), ["attention of a new token", "after 256", "after 4096", "ratio"]))
    print("\n" + stamp("python bench/mla.py " + " ".join(sys.argv[1:])))


if __name__ == "__main__":
    main()
