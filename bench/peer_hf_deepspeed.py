"""Against the stack a user would reach for: Hugging Face transformers' GPT2LMHeadModel + DeepSpeed ZeRO-3, at
the same model, batch and world size, on CPU (2 processes, gloo), against trainer3d at (dp=2, tp=1, pp=1) with
the same ZeRO-3 JSON (trainer3d/zero.py) and with DDP.

All variants live in the same two processes and are stepped in turn, the order rotated every round, so that
the shared machine's noise hits them alike; tokens/s ratios are medians of per-round ratios, from the wall
clock (a step is as slow as its slower rank) and from the CPU time both ranks spend in the step (steadier when
other jobs share the cores; gloo waits block without spinning). Same weights are
not needed for speed, but the sizes, the optimizer (torch AdamW, same parameter groups: decay on matrices),
clipping (1.0), batch (global 8 × 128 tokens, micro-batch 4 per rank) and loss (cross-entropy on the same 128
next tokens) are the same; dropout 0 everywhere.

Memory: from the malloc counter preloaded into the workers (bench/memhook.c): "static" is what a variant holds
after a step (everything built for it, relative to before it was built), "peak" is static plus the largest
increase during one of its steps. Both are per rank.

    python bench/peer_hf_deepspeed.py
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness import fmt_bytes, rotated, stamp, table, zero_available  # noqa: E402
from trainer3d.models.gpt2 import GPTConfig  # noqa: E402
from trainer3d.zero.ops import use_prebuilt_ops  # noqa: E402

SIZES = dict(n_layer=4, n_embd=128, n_head=4, n_positions=256, vocab=50257)


def ds_json(stage: int, micro: int, offload: bool = False) -> dict:
    from trainer3d.plan.report import deepspeed_config

    return deepspeed_config(zero_stage=stage, offload_optimizer=offload, offload_params=offload and stage == 3,
                            micro_batch_size=micro, micro_batches=1, dp=2, precision="fp32",
                            cfg=GPTConfig(n_layer=SIZES["n_layer"], n_embd=SIZES["n_embd"], n_head=SIZES["n_head"]))


class HFDeepSpeed:
    """GPT2LMHeadModel under deepspeed.initialize, the way its docs show it."""

    def __init__(self, ds_config: dict, lr: float = 1e-3, weight_decay: float = 0.1):
        import deepspeed
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(
            vocab_size=SIZES["vocab"], n_positions=SIZES["n_positions"], n_embd=SIZES["n_embd"],
            n_layer=SIZES["n_layer"], n_head=SIZES["n_head"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )
        torch.manual_seed(0)
        model = GPT2LMHeadModel(cfg)
        params = list(model.parameters())
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        if ds_config["zero_optimization"].get("offload_optimizer"):
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            opt = DeepSpeedCPUAdam(groups, lr=lr, betas=(0.9, 0.95))
        else:
            opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)
        deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=dict(ds_config))

    def train_step(self, batch):
        import torch.nn.functional as F

        logits = self.engine(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        self.engine.backward(loss)
        self.engine.step()
        return loss.item()


def ours(deepspeed_config: dict | None, micro: int, seq: int):
    from bench.harness import Case, build_trainer

    case = Case(dp=2, n_layer=SIZES["n_layer"], n_embd=SIZES["n_embd"], n_head=SIZES["n_head"], vocab=SIZES["vocab"],
                seq_len=seq, global_batch=2 * micro, deepspeed_config=deepspeed_config)
    topo, tr = build_trainer(case)
    return tr


def worker(rank: int, world: int, rounds: int, seq: int, micro: int, variants: list[str]) -> dict:
    import torch

    from bench.measure import MallocCounter

    torch.set_num_threads(1)
    mc = MallocCounter()
    g = torch.Generator().manual_seed(100 + rank)  # each dp rank its own rows
    batches = [torch.randint(0, SIZES["vocab"], (micro, seq + 1), generator=g) for _ in range(4)]
    steps, static, peak_inc, errors = {}, {}, {}, {}
    # one-time costs (gloo buffers, thread pools, lazy initialisation) before anything is measured
    warm = ours(None, 2, 16)
    warm.train_step(torch.randint(0, SIZES["vocab"], (2, 17), generator=g))
    del warm
    for name in variants:
        gc.collect()
        base = mc.current()
        try:
            if name == "trainer3d DDP":
                steps[name] = ours(None, micro, seq).train_step
            elif name == "trainer3d ZeRO-3":
                steps[name] = ours(ds_json(3, micro), micro, seq).train_step
            elif name == "HF + DeepSpeed ZeRO-3":
                steps[name] = HFDeepSpeed(ds_json(3, micro)).train_step
            elif name == "HF + DeepSpeed ZeRO-3 offload":
                steps[name] = HFDeepSpeed(ds_json(3, micro, offload=True)).train_step
            steps[name](batches[0])  # first step: lazy state, buffers
            static[name] = mc.current() - base
        except Exception as e:  # noqa: BLE001 - reported in the table (same on every rank)
            errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            steps.pop(name, None)
    names = list(steps)
    times = {k: [] for k in names}
    cpu = {k: [] for k in names}
    for i in range(rounds):
        for k in rotated(names, i):
            torch.distributed.barrier()
            before = mc.current()
            mc.reset_peak()
            t0, c0 = time.perf_counter(), time.process_time()
            steps[k](batches[i % 4])
            times[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
            peak_inc[k] = max(peak_inc.get(k, 0), mc.peak() - before)
    return dict(times=times, cpu=cpu, static=static, peak_inc=peak_inc, errors=errors)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch-size", type=int, default=4, help="per rank (global batch = 2 × this)")
    ap.add_argument("--offload", action="store_true", help="also HF + ZeRO-3 with CPU offload (DeepSpeedCPUAdam)")
    args = ap.parse_args(argv)
    use_prebuilt_ops()  # DeepSpeed's CPU ops in the checkout's .cache/torch_extensions (--build-ops)
    from bench.measure import preloaded_memhook
    from helpers.distributed import run_world

    variants = ["trainer3d DDP"] + (["trainer3d ZeRO-3"] if zero_available() else []) + ["HF + DeepSpeed ZeRO-3"]
    if args.offload:
        variants.append("HF + DeepSpeed ZeRO-3 offload")
    with preloaded_memhook():
        res = run_world(2, worker, args.rounds, args.seq_len, args.micro_batch_size, variants, timeout=1800)
    tokens = 2 * args.micro_batch_size * args.seq_len
    ref = "HF + DeepSpeed ZeRO-3"
    rows = []
    r0 = res[0]
    for name in variants:
        if name in r0["errors"]:
            rows.append([name, "-", "-", "-", "-", "-", "-", r0["errors"][name]])
            continue
        # a step is as slow as its slowest rank
        t = [max(a, b) for a, b in zip(res[0]["times"][name], res[1]["times"][name])]
        row = [name, f"{tokens / statistics.median(t):,.0f}"]
        if ref in r0["times"] and ref not in r0["errors"]:
            tr = [max(a, b) for a, b in zip(res[0]["times"][ref], res[1]["times"][ref])]
            row.append(f"{statistics.median([b / a for a, b in zip(t, tr)]):.3f}")
            # CPU time of both ranks per step: the work, without the waiting other jobs cause
            c = [a + b for a, b in zip(res[0]["cpu"][name], res[1]["cpu"][name])]
            cr = [a + b for a, b in zip(res[0]["cpu"][ref], res[1]["cpu"][ref])]
            row.append(f"{statistics.median([b / a for a, b in zip(c, cr)]):.3f}")
        else:
            row += ["-", "-"]
        st = max(r["static"][name] for r in res)
        pk = max(r["static"][name] + r["peak_inc"][name] for r in res)
        row += [fmt_bytes(st), fmt_bytes(pk)]
        if ref in r0["static"]:
            ref_pk = max(r["static"][ref] + r["peak_inc"][ref] for r in res)
            row.append(f"{pk / ref_pk:.3f}")
        else:
            row.append("-")
        row.append("")
        rows.append(row)
    print(table(rows, ["variant (2 ranks)", "tokens/s", "tokens/s vs HF+DS (wall, median)", "vs HF+DS (CPU time)",
                       "static/rank",
                       "peak/rank", "peak vs HF+DS", "note"]))
    print()
    print(f"model: GPT-2 L{SIZES['n_layer']} d{SIZES['n_embd']} h{SIZES['n_head']} vocab {SIZES['vocab']}; "
          f"global batch {2 * args.micro_batch_size} × {args.seq_len} tokens; fp32; {args.rounds} rounds")
    print(stamp("python bench/peer_hf_deepspeed.py " + " ".join(argv if argv is not None else sys.argv[1:])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
