"""Overhead of the trainer at (1,1,1): Trainer.train_step against a bare nanoGPT-style loop on the same plain
model (trainer3d.models.gpt2.GPT, same initial weights), same AdamW settings and parameter groups, same global-norm
clipping, same batches, on CPU, one thread each, in one process.

The variants are interleaved step by step, the order rotated every round (A B C, B C A, C A B, ...) so that
the noise of a shared machine hits all alike; the reported number is the median of the per-round ratios
tokens/s(trainer) / tokens/s(bare). The trainer does not do the same arithmetic as nanoGPT's loop: it pads
the vocabulary to a multiple of 128 (50257 -> 50304, which makes the head's matmuls faster on CPU, as nanoGPT's
own comment says) and its cross-entropy keeps one logits-sized temporary where F.cross_entropy makes several.
A third variant, "same-math bare", is the bare loop with both (padded vocab, the trainer's loss function): the
ratio against it is the framework's own cost.

On a machine shared with other jobs the wall-clock ratios scatter (other processes take the core mid-step);
each step's CPU time (time.process_time: this process only, one thread) is much steadier, so both are reported.

What the trainer does beyond the bare loop: torch.distributed.pipelining's schedule at pp=1 (micro-batch
split, stage bookkeeping), the vocab-parallel cross-entropy (a custom autograd function, also at tp=1), the
vocab padded to a multiple of 128 (50257 -> 50304: +0.09% head FLOPs), the loss/grad-norm all-reduces (no-ops at
world size 1) and the per-step memory report.

    python bench/overhead.py                     # the bench/overhead.md table (default tiny model, seq 128, batch 8)
    python bench/overhead.py --pairs 40 --model gpt2 --seq-len 256 --batch 4
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.harness import rotated, stamp, table  # noqa: E402


def make_trainer(cfg, mcfg):
    import torch.distributed as dist

    from trainer3d.train.setup import validate
    from trainer3d.train.trainer import Trainer

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    setup = validate(cfg, 1, mcfg.vocab_size)
    return Trainer(setup, setup.topology(), torch.device("cpu"), mcfg)


class BareLoop:
    """nanoGPT's train.py loop, minus the data loader and the logging: forward, F.cross_entropy, backward,
    clip_grad_norm_, AdamW step with a per-step learning rate."""

    def __init__(self, cfg, mcfg, same_math: bool = False):
        import dataclasses

        from trainer3d.models import init_value
        from trainer3d.models.gpt2 import GPT
        from trainer3d.parallel.tensor_parallel import padded_vocab_size
        from trainer3d.optim import lr_at

        self.cfg, self.lr_at = cfg, lr_at
        self.vocab = mcfg.vocab_size
        # same_math: the vocab padded as the trainer pads it (zero rows) and the trainer's loss function
        shape_cfg = dataclasses.replace(mcfg, vocab_size=padded_vocab_size(mcfg.vocab_size, 1)) if same_math else mcfg
        self.model = GPT(shape_cfg)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                full = init_value(mcfg, name, tuple(p.shape), cfg.seed) if name != "wte.weight" else init_value(
                    mcfg, name, (mcfg.vocab_size, mcfg.n_embd), cfg.seed)
                p.zero_()
                p[: full.shape[0]].copy_(full)
        params = list(self.model.parameters())
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        self.opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8)
        self.step = 0
        self.same_math = same_math

    def train_step(self, batch: torch.Tensor) -> float:
        x, y = batch[:, :-1], batch[:, 1:]
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        logits = self.model(x)
        if not self.same_math:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
        else:  # the trainer's loss function (no group: its all-reduces are no-ops), padding masked
            from trainer3d.parallel.cross_entropy import vocab_parallel_cross_entropy

            loss = vocab_parallel_cross_entropy(logits, y, None, 0, self.vocab).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        lr = self.lr_at(self.step, self.cfg)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        self.step += 1
        return loss.item()


def measure(model: str, seq_len: int, batch: int, pairs: int, warmup: int, n_layer=None, n_embd=None, n_head=None):
    from trainer3d.config import TrainConfig

    torch.set_num_threads(1)
    cfg = TrainConfig(model=model, seq_len=seq_len, global_batch=batch, precision="fp32", max_steps=10**6,
                      warmup_steps=10, n_layer=n_layer, n_embd=n_embd, n_head=n_head)
    mcfg = cfg.model_config(50257)
    variants = {
        "trainer": make_trainer(cfg, mcfg).train_step,
        "bare": BareLoop(cfg, mcfg).train_step,
        "bare-same-math": BareLoop(cfg, mcfg, same_math=True).train_step,
    }
    names = list(variants)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, mcfg.vocab_size, (batch, seq_len + 1), generator=g) for _ in range(8)]

    def timed(fn, b):
        c0, t0 = time.process_time(), time.perf_counter()
        fn(b)
        return time.perf_counter() - t0, time.process_time() - c0

    for i in range(warmup):
        for fn in variants.values():
            timed(fn, batches[i % 8])
    times = {k: [] for k in names}
    cpu = {k: [] for k in names}
    for i in range(pairs):
        b = batches[i % 8]
        for k in rotated(names, i):
            wall, c = timed(variants[k], b)
            times[k].append(wall)
            cpu[k].append(c)
    t_tr, t_bare, t_own = times["trainer"], times["bare"], times["bare-same-math"]
    ratios = [c / a for a, c in zip(t_tr, t_bare)]  # tokens/s ratio = time(bare) / time(trainer), per round
    ratios_own = [c / a for a, c in zip(t_tr, t_own)]
    cpu_ratio = statistics.median(c / a for a, c in zip(cpu["trainer"], cpu["bare"]))
    cpu_ratio_own = statistics.median(c / a for a, c in zip(cpu["trainer"], cpu["bare-same-math"]))
    tokens = batch * seq_len
    q = statistics.quantiles(ratios, n=4)
    return dict(
        model=model if n_embd is None else f"{model} (L{n_layer} d{n_embd})",
        params=mcfg.num_params(), tokens=tokens, pairs=pairs,
        tps_trainer=tokens / statistics.median(t_tr), tps_bare=tokens / statistics.median(t_bare),
        ratio=statistics.median(ratios), q1=q[0], q3=q[2],
        tps_own=tokens / statistics.median(t_own), ratio_own=statistics.median(ratios_own),
        cpu_ratio=cpu_ratio, cpu_ratio_own=cpu_ratio_own,
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--also-wide", action="store_true", help="also a wider model (L4 d256), where the head matters less")
    args = ap.parse_args(argv)
    runs = [measure(args.model, args.seq_len, args.batch, args.pairs, args.warmup)]
    if args.also_wide:
        runs.append(measure(args.model, args.seq_len, args.batch, args.pairs, args.warmup, n_layer=4, n_embd=256,
                            n_head=4))
    rows = [[r["model"], f"{r['params'] / 1e6:.1f}M", r["tokens"], r["pairs"], f"{r['tps_trainer']:,.0f}",
             f"{r['tps_bare']:,.0f}", f"{r['ratio']:.3f}", f"{r['q1']:.3f}-{r['q3']:.3f}",
             f"{r['cpu_ratio']:.3f}", f"{r['tps_own']:,.0f}", f"{r['ratio_own']:.3f}", f"{r['cpu_ratio_own']:.3f}"]
            for r in runs]
    print(table(rows, ["model", "params", "tokens/step", "rounds", "trainer tok/s", "bare tok/s",
                       "trainer/bare (wall)", "IQR", "trainer/bare (CPU time)", "same-math bare tok/s",
                       "trainer/same-math (wall)", "trainer/same-math (CPU time)"]))
    print()
    cmd = "python bench/overhead.py" + "".join(
        f" {a}" for a in argv or sys.argv[1:]
    )
    print(stamp(cmd))
    return 0 if all(math.isfinite(r["ratio"]) for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
