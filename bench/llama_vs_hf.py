"""Llama: trainer3d at (1,1,1) against Hugging Face's LlamaForCausalLM trained by a plain loop, at the same shape, on
CPU, fp32, one thread: step time and peak memory.

Both sides take the same AdamW (trainer3d.optim.adam: torch's fused kernel; decay on matrices only), the same
global-norm clip and the same batches. The plain loop is what transformers' docs show: `model(ids).logits`,
`F.cross_entropy`, backward, clip, step. Hugging Face runs its default attention (SDPA), keeps q, k, v and gate, up as
separate linears and computes the loss on the whole logits; trainer3d fuses them (one matmul each), pads the
vocabulary to a multiple of 128 and computes the loss in chunks.

Time: both models in one process, one step each in turn, the order rotated every round; the median of the per-round
ratios (the machines are noisy: a ratio inside one run, never an absolute speed from a CPU).
Memory: each side in a process of its own, three steps; the peak resident set sampled from outside (/proc/<pid>/status
VmHWM, read by this process) and the peak of the process's own malloc counter (bench/memhook.c) over the steps, after
the model is built.

    python bench/llama_vs_hf.py                  # the bench/llama_vs_hf.md table: llama-tiny and a mid-size shape
    python bench/llama_vs_hf.py --rounds 20 --shapes mid
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.harness import fmt_bytes, rotated, stamp, table  # noqa: E402
from bench.measure import MallocCounter, run_under_memhook  # noqa: E402

VOCAB = 32768  # a multiple of 128: no padding on trainer3d's side, the same head on both
SHAPES = {  # model flags, sequence length, sequences per step
    "llama-tiny": (dict(n_layer=4, n_embd=128, n_head=4, n_kv_heads=2, ffn_hidden=384), 128, 8),
    "mid": (dict(n_layer=6, n_embd=384, n_head=6, n_kv_heads=2, ffn_hidden=1024), 256, 2),
}


def train_config(shape: str):
    from trainer3d.config import TrainConfig

    sizes, seq_len, batch = SHAPES[shape]
    return TrainConfig(model="llama-tiny", vocab_size=VOCAB, seq_len=seq_len, global_batch=batch, precision="fp32",
                       max_steps=10**6, warmup_steps=10, **sizes)


def trainer3d_step(shape: str):
    import torch.distributed as dist

    from trainer3d.train.setup import validate
    from trainer3d.train.trainer import Trainer

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cfg = train_config(shape)
    setup = validate(cfg, 1)
    trainer = Trainer(setup, setup.topology(), torch.device("cpu"), setup.model_config(VOCAB))
    return lambda batch: trainer.train_step(batch)["loss"]


def hf_step(shape: str):
    from transformers import LlamaForCausalLM

    from trainer3d.models import family_of
    from trainer3d.optim import adam, lr_at, param_groups, set_lr

    cfg = train_config(shape)
    mcfg = cfg.model_config(VOCAB)
    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(family_of(mcfg).hf.hf_config(mcfg)).train()
    params = list(model.parameters())
    opt = adam(param_groups(params, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8)
    state = {"step": 0}

    def step(batch: torch.Tensor) -> float:
        logits = model(batch[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        set_lr(opt, lr_at(state["step"], cfg))
        opt.step()
        opt.zero_grad(set_to_none=True)
        state["step"] += 1
        return loss.item()

    return step


SIDES = {"trainer3d": trainer3d_step, "transformers": hf_step}


def batches(shape: str, n: int = 4) -> list[torch.Tensor]:
    _, seq_len, batch = SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (batch, seq_len + 1), generator=g) for _ in range(n)]


def time_both(shape: str, rounds: int, warmup: int = 2) -> dict:
    torch.set_num_threads(1)
    steps = {name: make(shape) for name, make in SIDES.items()}
    data, names = batches(shape), list(SIDES)
    for i in range(warmup):
        for fn in steps.values():
            fn(data[i % len(data)])
    times = {k: [] for k in names}
    for i in range(rounds):
        for k in rotated(names, i):
            t0 = time.perf_counter()
            steps[k](data[i % len(data)])
            times[k].append(time.perf_counter() - t0)
    ratios = [h / t for t, h in zip(times["trainer3d"], times["transformers"])]  # >1: trainer3d faster
    return {"ratio": statistics.median(ratios), "q": statistics.quantiles(ratios, n=4),
            **{f"{k}_s": statistics.median(v) for k, v in times.items()}}


def memory_child(shape: str, side: str) -> None:
    """In its own process (started by memory_of): build one side, then three steps; print the step's malloc peak."""
    torch.set_num_threads(1)
    step = SIDES[side](shape)
    counter = MallocCounter()
    base = counter.current()
    counter.reset_peak()
    for b in batches(shape, 3):
        step(b)
    print(json.dumps({"built": base, "peak": counter.peak()}))


def memory_of(shape: str, side: str) -> dict:
    return run_under_memhook([sys.executable, os.path.abspath(__file__), "--child", shape, side], ROOT)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        memory_child(*args.child)
        return 0
    rows = []
    for shape in args.shapes:
        mcfg = train_config(shape).model_config(VOCAB)
        t = time_both(shape, args.rounds)
        mem = {side: memory_of(shape, side) for side in SIDES}
        _, seq_len, batch = SHAPES[shape]
        rows.append([shape, f"{mcfg.num_params() / 1e6:.1f}M", batch * seq_len,
                     f"{t['trainer3d_s'] * 1e3:.0f}", f"{t['transformers_s'] * 1e3:.0f}",
                     f"{t['ratio']:.2f} ({t['q'][0]:.2f}-{t['q'][2]:.2f})",
                     fmt_bytes(mem["trainer3d"]["hwm"]), fmt_bytes(mem["transformers"]["hwm"]),
                     fmt_bytes(mem["trainer3d"]["peak"]), fmt_bytes(mem["transformers"]["peak"]),
                     f"{mem['trainer3d']['peak'] / mem['transformers']['peak']:.2f}"])
    print(table(rows, ["shape", "params", "tokens/step", "trainer3d ms", "HF loop ms", "HF/trainer3d time (IQR)",
                       "trainer3d RSS peak", "HF RSS peak", "trainer3d malloc peak", "HF malloc peak",
                       "malloc peak ratio"]))
    print()
    print(stamp("python bench/llama_vs_hf.py" + "".join(f" {a}" for a in (argv or sys.argv[1:]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
