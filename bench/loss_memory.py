"""The vocab-parallel cross-entropy in chunks of tokens against the implementation before chunking (kept below as
`_Before`, verbatim), by memory on top of the logits, in a subprocess with the malloc counter (bench/memhook.c)
preloaded.

One micro-batch of 8 × 1024 tokens, GPT-2's padded vocabulary (50304) split over tp = 1, 2, 8 (one shard
computed: the collectives are no-ops at one process and move only [tokens]-sized vectors anyway), logits in fp32
and in bf16 (the dtype of the stage output under bf16). Forward, then backward with the gradient of the mean;
the peak counts everything malloc'd above the logits, the gradient of the logits included (it is the output of
the backward, the same in both). Expected unchunked extra: the fp32 softmax saved for the backward plus its
cast to bf16 under bf16; chunked: a chunk's fp32 temporaries. "held" is what stays allocated from the loss's
forward to its backward (under 1F1B, while the other micro-batches' forwards and backwards run; under GPipe, for
every micro-batch at once).

    python bench/loss_memory.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

from bench.harness import stamp, table  # noqa: E402
from bench.measure import MallocCounter, preloaded_memhook  # noqa: E402

TOKENS, VOCAB = 8 * 1024, 50304


def _before():
    """trainer3d/parallel/tensor_parallel.py's loss at commit c5d8892, the baseline (group None: one process)."""
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

    return _Before.apply


def measure(tp: int, dtype: str, chunked: bool) -> dict:
    import torch

    from trainer3d.parallel.cross_entropy import vocab_parallel_cross_entropy

    counter = MallocCounter()
    torch.manual_seed(0)
    shard = VOCAB // tp
    logits = torch.randn(8, 1024, shard, dtype=getattr(torch, dtype)).requires_grad_()
    target = torch.randint(0, shard, (8, 1024))
    base = counter.current()
    counter.reset_peak()
    if chunked:
        loss = vocab_parallel_cross_entropy(logits, target, None, 0, VOCAB).mean()
    else:
        loss = _before()(logits, target, VOCAB).mean()
    after_forward = counter.current() - base
    loss.backward()
    peak = counter.peak() - base
    grad_bytes = logits.grad.numel() * logits.grad.element_size()
    return {"tp": tp, "dtype": dtype, "chunked": chunked, "peak": peak, "held_after_forward": after_forward,
            "logits": logits.numel() * logits.element_size(), "grad": grad_bytes, "loss": loss.item()}


def main() -> None:
    if len(sys.argv) == 4:  # the worker: python bench/loss_memory.py TP DTYPE CHUNKED
        print(json.dumps(measure(int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1")))
        return
    rows, results = [], []
    mib = lambda b: f"{b / 2**20:,.0f}"  # noqa: E731
    with preloaded_memhook():
        for tp in (1, 2, 8):
            for dtype in ("float32", "bfloat16"):
                pair = []
                for chunked in (False, True):
                    out = subprocess.run([sys.executable, __file__, str(tp), dtype, "1" if chunked else "0"],
                                         capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
                    pair.append(json.loads(out.stdout.strip().splitlines()[-1]))
                old, new = pair
                assert abs(old["loss"] - new["loss"]) <= 1e-6 * abs(old["loss"]), (old, new)
                results += pair
                rows.append([tp, dtype, mib(old["logits"]), mib(old["held_after_forward"]), mib(new["held_after_forward"]),
                             mib(old["peak"]), mib(new["peak"]), mib(old["peak"] - new["peak"]),
                             f"{new['peak'] / old['peak']:.2f}"])
    print(table(rows, ["tp", "logits", "logits MiB", "held fwd→bwd, before", "held, chunked",
                       "peak above logits, before", "peak, chunked", "saved MiB", "ratio"]))
    print(stamp("python bench/loss_memory.py"))
    with open(os.path.join(ROOT, "bench", "results", "loss_memory.json"), "w") as f:
        json.dump({"stamp": stamp("python bench/loss_memory.py"), "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
