"""The vocab-parallel cross-entropy three ways, by memory on top of the logits (in a subprocess with the malloc
counter, bench/memhook.c, preloaded) and by time (all three in one process, interleaved):

- "saved softmax": the implementation at c5d8892 (kept below as `_saved_softmax`, verbatim but for the collectives):
  an fp32 softmax saved for the backward and reused as the gradient;
- "recompute": 42f4bb8 to 6192886 (`_recompute`): chunks of tokens, only the logits, max and sum saved, each chunk's
  softmax recomputed in the backward into a new gradient;
- "in place": `trainer3d.parallel.cross_entropy` now: the exponentials written over the logits, then scaled into the
  gradient in place (Megatron's scheme), the fp32 work of low-precision logits in chunks.

One micro-batch of 8 × 1024 tokens, GPT-2's padded vocabulary (50304) split over tp = 1, 2, 8 (one shard computed:
the collectives are no-ops at one process and move only [tokens]-sized vectors anyway), logits in fp32 and in bf16
(the dtype of the stage output under bf16). Forward, then backward with the gradient of the mean; the peak counts
everything malloc'd above the logits, the gradient of the logits included. "held" is what stays allocated from the
loss's forward to its backward (under 1F1B, while the other micro-batches' forwards and backwards run; under GPipe,
for every micro-batch at once). Time: forward + backward of the loss alone, one thread, the median of per-round
ratios against "saved softmax".

    python bench/loss_memory.py            # memory table, then time table (~2 min)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

from bench.harness import rotated, stamp, table  # noqa: E402
from bench.measure import MallocCounter, preloaded_memhook  # noqa: E402

TOKENS, VOCAB = 8 * 1024, 50304
KINDS = ("saved softmax", "recompute", "in place")


def _saved_softmax():
    """trainer3d/parallel/tensor_parallel.py's loss at commit c5d8892 (group None: one process)."""
    import torch

    class _Before(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits, target, vocab_size):
            n_valid = min(logits.shape[-1], vocab_size)
            logits_max = logits[..., :n_valid].max(dim=-1)[0].float()
            shifted = logits.float() - logits_max.unsqueeze(-1)
            if n_valid < logits.shape[-1]:
                shifted[..., n_valid:] = float("-inf")
            target_logit = shifted.gather(-1, target.unsqueeze(-1)).squeeze(-1)
            softmax = shifted.exp_()
            sum_exp = softmax.sum(dim=-1)
            loss = torch.log(sum_exp) - target_logit
            softmax.div_(sum_exp.unsqueeze(-1))
            ctx.save_for_backward(softmax, target)
            ctx.input_dtype = logits.dtype
            return loss

        @staticmethod
        def backward(ctx, grad_loss):
            softmax, target = ctx.saved_tensors
            grad = softmax
            grad.scatter_add_(-1, target.unsqueeze(-1), -torch.ones_like(target.unsqueeze(-1), dtype=grad.dtype))
            grad.mul_(grad_loss.unsqueeze(-1))
            return grad.to(ctx.input_dtype), None, None

    return lambda logits, target: _Before.apply(logits, target, VOCAB)


def _recompute():
    """cross_entropy._VocabParallelCrossEntropy from 42f4bb8 to 6192886 (group None, all targets in the shard)."""
    import torch

    def spans(n, chunk):
        return [(a, min(a + chunk, n)) for a in range(0, n, chunk)]

    def shifted_of(logits, logits_max, n_valid):
        shifted = logits.float() - logits_max.unsqueeze(-1)
        if n_valid < shifted.shape[-1]:
            shifted[:, n_valid:] = float("-inf")
        return shifted

    class _Recompute(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits, target, vocab_size, chunk):
            n_valid = min(logits.shape[-1], vocab_size)
            flat, tgt = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
            n = flat.shape[0]
            logits_max = torch.empty(n)
            for a, b in spans(n, chunk):
                logits_max[a:b] = flat[a:b, :n_valid].max(dim=-1)[0].float()
            sums = torch.empty(2, n)
            for a, b in spans(n, chunk):
                shifted = shifted_of(flat[a:b], logits_max[a:b], n_valid)
                sums[0, a:b] = shifted.gather(-1, tgt[a:b].unsqueeze(-1)).squeeze(-1)
                sums[1, a:b] = shifted.exp_().sum(dim=-1)
            target_logit, sum_exp = sums
            ctx.save_for_backward(logits, logits_max, sum_exp, tgt)
            ctx.n_valid, ctx.chunk = n_valid, chunk
            return (torch.log(sum_exp) - target_logit).view(target.shape)

        @staticmethod
        def backward(ctx, grad_loss):
            logits, logits_max, sum_exp, tgt = ctx.saved_tensors
            flat, g = logits.reshape(-1, logits.shape[-1]), grad_loss.reshape(-1)
            grad = torch.empty_like(flat)
            for a, b in spans(flat.shape[0], ctx.chunk):
                softmax = shifted_of(flat[a:b], logits_max[a:b], ctx.n_valid).exp_().div_(sum_exp[a:b].unsqueeze(-1))
                softmax.scatter_add_(-1, tgt[a:b].unsqueeze(-1), -torch.ones(b - a, 1))
                grad[a:b] = softmax.mul_(g[a:b].unsqueeze(-1))
            return grad.view_as(logits), None, None, None

    return lambda logits, target: _Recompute.apply(logits, target, VOCAB, max(1, (1 << 22) // logits.shape[-1]))


def _in_place():
    from trainer3d.parallel.cross_entropy import vocab_parallel_cross_entropy

    return lambda logits, target: vocab_parallel_cross_entropy(logits, target, None, 0, VOCAB)


LOSSES = dict(zip(KINDS, (_saved_softmax, _recompute, _in_place)))


def _logits(tp: int, dtype: str):
    """A leaf to make non-leaf logits from (as the head's output is), and the targets."""
    import torch

    torch.manual_seed(0)
    shard = VOCAB // tp
    leaf = torch.randn(8, 1024, shard, dtype=getattr(torch, dtype)).requires_grad_()
    return leaf, torch.randint(0, shard, (8, 1024))


def measure_memory(tp: int, dtype: str, kind: str) -> dict:
    import torch

    counter = MallocCounter()
    leaf, target = _logits(tp, dtype)
    loss_fn = LOSSES[kind]()
    logits = leaf * 1.0
    base = counter.current()
    counter.reset_peak()
    loss = loss_fn(logits, target).mean()
    after_forward = counter.current() - base
    grad, = torch.autograd.grad(loss, logits)
    peak = counter.peak() - base
    return {"tp": tp, "dtype": dtype, "kind": kind, "peak": peak, "held_after_forward": after_forward,
            "logits": leaf.numel() * leaf.element_size(), "grad_is_logits": grad.data_ptr() == logits.data_ptr(),
            "loss": loss.item()}


def measure_time(tp: int, dtype: str, rounds: int) -> dict:
    """Seconds of CPU time (one thread) per forward + backward, every kind once a round, the order rotated."""
    import torch

    torch.set_num_threads(1)
    leaf, target = _logits(tp, dtype)
    fns, seconds = {k: LOSSES[k]() for k in KINDS}, {k: [] for k in KINDS}
    for r in range(rounds + 1):
        for kind in rotated(list(KINDS), r):
            logits = leaf * 1.0  # the in-place loss consumes its logits
            t0 = time.process_time()
            torch.autograd.grad(fns[kind](logits, target).mean(), logits)
            if r:  # the first round warms the allocator
                seconds[kind].append(time.process_time() - t0)
    base = seconds[KINDS[0]]
    return {"tp": tp, "dtype": dtype, "rounds": rounds,
            "ms": {k: 1e3 * statistics.median(v) for k, v in seconds.items()},
            "ratio": {k: statistics.median(b / x for b, x in zip(base, v)) for k, v in seconds.items()}}


def _worker(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    if out.returncode:
        raise SystemExit(f"worker {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) == 5:  # a worker: python bench/loss_memory.py memory|time TP DTYPE KIND|ROUNDS
        what, tp, dtype, arg = sys.argv[1:]
        print(json.dumps(measure_memory(int(tp), dtype, arg) if what == "memory" else
                         measure_time(int(tp), dtype, int(arg))))
        return
    mem_rows, time_rows, results = [], [], []
    mib = lambda b: f"{b / 2**20:,.0f}"  # noqa: E731
    with preloaded_memhook():
        for tp in (1, 2, 8):
            for dtype in ("float32", "bfloat16"):
                runs = [_worker("memory", str(tp), dtype, kind) for kind in KINDS]
                for r in runs[1:]:
                    assert abs(r["loss"] - runs[0]["loss"]) <= 1e-6 * abs(runs[0]["loss"]), runs
                results += runs
                mem_rows.append([tp, dtype, mib(runs[0]["logits"])]
                                + [mib(r["held_after_forward"]) for r in runs] + [mib(r["peak"]) for r in runs]
                                + ["yes" if runs[2]["grad_is_logits"] else "no"])
    for tp in (1, 8):
        for dtype in ("float32", "bfloat16"):
            t = _worker("time", str(tp), dtype, "7")
            results.append(t)
            time_rows.append([tp, dtype] + [f"{t['ms'][k]:,.0f}" for k in KINDS]
                             + [f"{t['ratio'][k]:.2f}" for k in KINDS[1:]])
    print(table(mem_rows, ["tp", "logits", "logits MiB"] + [f"held fwd→bwd, {k}" for k in KINDS]
                + [f"peak above logits, {k}" for k in KINDS] + ["gradient in the logits' storage"]))
    print()
    print(table(time_rows, ["tp", "logits"] + [f"ms, {k}" for k in KINDS]
                + [f"speed vs saved softmax, {k}" for k in KINDS[1:]]))
    print(stamp("python bench/loss_memory.py"))
    with open(os.path.join(ROOT, "bench", "results", "loss_memory.json"), "w") as f:
        json.dump({"stamp": stamp("python bench/loss_memory.py"), "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
