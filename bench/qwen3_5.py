"""Qwen3.5 on CPU, fp32, one thread: one Gated DeltaNet layer, trainer3d's `GatedDeltaNet` (its chunked recurrence
in torch, models/qwen3_5/delta_rule.py) against transformers' `Qwen3_5GatedDeltaNet` (its torch path, which it takes
without flash-linear-attention), forward and backward, at Qwen3.5's linear-attention shape scaled to a CPU (hidden
1024, 4 key heads serving 8 value heads of 64 dims, conv kernel 4) at two lengths: how time and memory grow with the
length. Time: both sides in one process, rotated each round, the median of per-round ratios to trainer3d's. Memory:
each side and length in its own process, the malloc peak of three passes (bench/memhook.c) and the resident-set
high-water mark read from outside (/proc/<pid>/status VmHWM).

Decoding: `trainer3d.sample`'s path (a prefill, then one token at a time through the cache: each linear block's conv
window and state, each full block's keys and values) on a small Qwen3.5 and a Llama of the same width and depth, the
time per new token after prompts of two lengths.

    python bench/qwen3_5.py --rounds 5
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from bench.harness import length_rows, lengths_cli, stamp, table  # noqa: E402

SHAPE = dict(hidden_size=1024, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
             linear_value_head_dim=64, linear_conv_kernel_dim=4)
LENGTHS = (1024, 4096)


def _hf_config():
    import transformers

    return transformers.Qwen3_5TextConfig(**SHAPE, num_hidden_layers=1, vocab_size=1024, num_attention_heads=8,
                                          num_key_value_heads=2, head_dim=64, intermediate_size=2048)


def _hf_side():
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    layer = Qwen3_5GatedDeltaNet(_hf_config(), layer_idx=0)
    return layer, lambda x: layer(x)


def _ours_side():
    from trainer3d.models.qwen3_5.hf import Qwen35Adapter
    from trainer3d.models.qwen3_5.model import GatedDeltaNet

    layer = GatedDeltaNet(Qwen35Adapter().config_from_hf(_hf_config().to_dict(), dropout=0.0))
    return layer, layer


SIDES = {"trainer3d GatedDeltaNet": _ours_side, "transformers (torch path)": _hf_side}


def _pass_of(make, tokens: int):
    module, forward = make()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name == "A_log":
                p.copy_(torch.empty_like(p).uniform_(1, 16).log())
            else:
                p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    x = torch.randn(1, tokens, SHAPE["hidden_size"], requires_grad=True)
    target = torch.randn(1, tokens, SHAPE["hidden_size"])

    def run():
        (forward(x) * target).sum().backward()
        module.zero_grad(set_to_none=True)
        x.grad = None

    return run


def _side_pass(side: str, tokens: int):
    return _pass_of(SIDES[side], tokens)


def decode_rows(rounds: int, prompts=(256, 4096), per_round: int = 8) -> list[list]:
    """ms per new token after prompts of two lengths, through the model's cache (trainer3d.generate's path): each
    (model, prompt) prefilled once, then `per_round` tokens decoded by each in turn, rotated, every round; the median
    of the rounds."""
    import statistics

    from bench.harness import rotated
    from trainer3d.models import MODEL_PRESETS, build_model
    from trainer3d.models.attention import KVCache

    q35 = dataclasses.replace(MODEL_PRESETS["qwen3.5-tiny"], vocab_size=4096, n_embd=512, n_head=8, n_kv_heads=2,
                              explicit_head_dim=64, linear_key_heads=4, linear_value_heads=8, linear_key_head_dim=64,
                              linear_value_head_dim=64, ffn_hidden=1536)
    llama = dataclasses.replace(MODEL_PRESETS["llama-tiny"], vocab_size=4096, n_embd=512, n_head=8, n_kv_heads=2,
                                n_layer=q35.n_layer, ffn_hidden=1536)
    models = {"Qwen3.5 (6 linear + 2 full blocks)": q35, "Llama (8 full blocks)": llama}
    runs, times = {}, {}
    for label, cfg in models.items():
        torch.manual_seed(0)
        model = build_model(cfg)
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.02)
        model.init_tables(torch.device("cpu"))
        model.eval()
        for prompt in prompts:
            cache = KVCache(max_len=prompt + (rounds + 1) * per_round)
            with torch.no_grad():
                model(torch.randint(0, cfg.vocab_size, (1, prompt)), cache)
            runs[label, prompt] = (model, cache, cfg.vocab_size)
            times[label, prompt] = []
    for r in range(rounds + 1):
        for key in rotated(list(runs), r):
            model, cache, vocab = runs[key]
            token = torch.randint(0, vocab, (1, 1))
            with torch.no_grad():
                t0 = time.perf_counter()
                for _ in range(per_round):
                    model(token, cache)
                if r:  # the first round warms up
                    times[key].append((time.perf_counter() - t0) / per_round * 1e3)
    rows = []
    for label in models:
        short, long = (statistics.median(times[label, p]) for p in prompts)
        rows.append([label, f"{short:.2f}", f"{long:.2f}", f"{long / short:.2f}"])
    return rows


def main() -> None:
    args = lengths_cli(__doc__, 5, _side_pass)
    if args is None:
        return
    shape = ", ".join(f"{k} {v}" for k, v in SHAPE.items())
    print(f"One Gated DeltaNet layer ({shape}), forward + backward:\n")
    rows = length_rows(__file__, _side_pass, SIDES, LENGTHS, args.rounds, "trainer3d GatedDeltaNet")
    print(table(rows, ["tokens", "side", "ms", "time / trainer3d", "malloc peak", "RSS high-water (outside)"]))
    print("\nDecoding through the cache, ms per new token (the median of rounds of 8) after a prompt of 256 and of 4096 "
          "tokens:\n")
    print(table(decode_rows(args.rounds * 3), ["model (width 512)", "after 256", "after 4096", "ratio"]))
    print("\n" + stamp("python bench/qwen3_5.py " + " ".join(sys.argv[1:])))


if __name__ == "__main__":
    main()
