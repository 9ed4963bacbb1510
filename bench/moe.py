"""Mixture of experts on CPU, fp32: the block against transformers', and expert parallelism's cost.

`--sections block`: one MoE layer (Qwen3-30B-A3B's routing: 128 experts... scaled to a CPU: 32 experts, top 4,
H 512, I 256, 2048 tokens), forward and backward, trainer3d's `models/moe.MoE` (the grouped matmul, and its per-expert
loop) against transformers' `Qwen3MoeSparseMoeBlock` with its `eager` experts (a loop over the experts hit) and its
`grouped_mm` ones. Time: all sides in one process, rotated each round, the median of per-round ratios to trainer3d's
grouped matmul. Memory: each side in its own process, the malloc peak of the three passes (bench/memhook.c) and the
resident-set high-water mark read from outside (/proc/<pid>/status VmHWM).

`--sections ep`: a Qwen3-MoE (16 experts, top 2) at dp 4 with its experts over ep 1, 2 and 4, one world of 4
processes: each rank's parameter bytes, its all-to-all bytes per step (bench/measure.CommCounter) against the count
of the dispatch rule (per MoE layer and micro-batch: the rows sent forward, their combine back, and the same two in
the backward: 4·N·k·H·4 bytes as a mean over the ranks, plus the E·8-byte count exchange; what crosses the wire is
the (ep−1)/ep of it bound for other ranks), the step time as a ratio to ep 1 (the median of
rounds that rotate the layouts), and each rank's peak malloc during a step.

    python bench/moe.py                       # both sections, the bench/moe.md tables
    python bench/moe.py --sections block --rounds 20
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import trainer3d.models.moe as moe_module  # noqa: E402
from bench.harness import (  # noqa: E402
    Case, build_trainer, fmt_bytes, local_batch, print_malloc_peak, rotated, stamp, table, time_rotated,
)
from bench.measure import CommCounter, MallocCounter, preloaded_memhook, run_under_memhook  # noqa: E402

BLOCK = dict(hidden=512, experts=32, top_k=4, expert_hidden=256, tokens=2048)


# ---- block ------------------------------------------------------------------------------------------------------
def _hf_block(implementation: str):
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = transformers.Qwen3MoeConfig(hidden_size=BLOCK["hidden"], num_experts=BLOCK["experts"],
                                      num_experts_per_tok=BLOCK["top_k"], moe_intermediate_size=BLOCK["expert_hidden"],
                                      norm_topk_prob=True)
    cfg._experts_implementation = implementation
    return Qwen3MoeSparseMoeBlock(cfg)


def _ours(module=moe_module):
    return module.MoE(BLOCK["hidden"], module.MoESpec(BLOCK["experts"], BLOCK["top_k"], BLOCK["expert_hidden"]),
                      layer=0)


BEFORE = "63bbd8e"  # the block before issue 42's fixes (its models/moe.py imports torch alone)


def _before():
    """models/moe.py as it was at BEFORE, loaded from git as a module of its own."""
    import importlib.util
    import subprocess

    source = subprocess.run(["git", "show", f"{BEFORE}:trainer3d/models/moe.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    spec = importlib.util.spec_from_loader("moe_before", loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules["moe_before"] = module  # dataclasses look their module up
    exec(compile(source, f"{BEFORE}:trainer3d/models/moe.py", "exec"), module.__dict__)
    return _ours(module)


SIDES = {"trainer3d grouped_mm": _ours, "trainer3d loop": _ours, f"trainer3d before ({BEFORE})": _before,
         "transformers eager": lambda: _hf_block("eager"), "transformers grouped_mm": lambda: _hf_block("grouped_mm")}
GROUPED_RULE = moe_module.grouped_mm_applies


def path_for(side: str) -> None:
    """trainer3d's experts take the per-expert loop where the grouped matmul's alignment rule fails: the loop side
    has the rule answer no (the module's function, looked up at each call)."""
    moe_module.grouped_mm_applies = (lambda *a: False) if side == "trainer3d loop" else GROUPED_RULE


def _pass_of(block):
    """Forward and backward of one [1, tokens, H] batch, the weights initialized alike (N(0, 0.02))."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    x = torch.randn(1, BLOCK["tokens"], BLOCK["hidden"], requires_grad=True)
    target = torch.randn(1, BLOCK["tokens"], BLOCK["hidden"])

    def run():
        out = block(x)
        out = out[0] if isinstance(out, tuple) else out
        (out * target).sum().backward()
        block.zero_grad(set_to_none=True)
        x.grad = None

    return run


def time_block(rounds: int) -> dict:
    torch.set_num_threads(1)
    passes = {name: _pass_of(make()) for name, make in SIDES.items()}
    return time_rotated(passes, rounds, "trainer3d grouped_mm", before=path_for)


def block_memory_child(side: str) -> None:
    torch.set_num_threads(1)
    path_for(side)
    print_malloc_peak(_pass_of(SIDES[side]()))


def child_memory(args: list[str]) -> dict:
    """Run this file with `args` in a process of its own; its printed JSON plus its VmHWM read from outside."""
    return run_under_memhook([sys.executable, os.path.abspath(__file__), *args], ROOT)


def host_reads(side: str) -> int:
    """The reads one forward and backward would make of a device's memory (tests/test_moe_reads.HostReads: the ATen
    ops whose result needs the data on the host, and tolist/numpy)."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_moe_reads import HostReads

    path_for(side)
    run = _pass_of(SIDES[side]())
    with HostReads() as reads:
        run()
    return len(reads.reads)


def block_section(rounds: int) -> str:
    t = time_block(rounds)
    rows = []
    for side in SIDES:
        mem = child_memory(["--block-child", side])
        rows.append([side, f"{t[side][0] * 1e3:.0f}", f"{t[side][1]:.2f}", host_reads(side), fmt_bytes(mem["peak"]),
                     fmt_bytes(mem["hwm"])])
    shape = ", ".join(f"{k} {v}" for k, v in BLOCK.items())
    return f"One MoE layer ({shape}), forward + backward:\n\n" + table(
        rows, ["side", "ms", "time / trainer3d grouped_mm", "host reads", "malloc peak", "RSS high-water (outside)"])


# ---- expert parallelism ---------------------------------------------------------------------------------------------
EP_MODEL = dict(n_layer=4, n_embd=128, n_head=4, vocab=2048, seq_len=128, global_batch=16)
EP_FLAGS = dict(model="qwen3-moe-tiny", n_kv_heads=2, n_experts=16, top_k=2, moe_ffn_hidden=96)


def ep_case(ep: int) -> Case:
    return Case(dp=4, micro_batches=2, extra=dict(EP_FLAGS, ep=ep), **EP_MODEL)


def measure_ep(rank: int, world: int, eps: list[int], rounds: int) -> dict:
    counter, malloc = CommCounter().install(), MallocCounter()
    built = {}
    for ep in eps:
        case = ep_case(ep)
        topo, trainer = build_trainer(case)
        trainer.train_step(local_batch(case, topo, 0))  # Adam's state, the buckets
        built[ep] = (case, topo, trainer)
    out = {ep: {"times": [], "a2a": 0, "peak": 0} for ep in eps}
    for i in range(rounds):
        for ep in rotated(eps, i):
            case, topo, trainer = built[ep]
            counter.reset()
            counter.enabled = True
            malloc.reset_peak()
            base = malloc.current()
            t0 = time.perf_counter()
            trainer.train_step(local_batch(case, topo, i + 1))
            out[ep]["times"].append(time.perf_counter() - t0)
            counter.enabled = False
            out[ep]["peak"] = max(out[ep]["peak"], malloc.peak() - base)
            out[ep]["a2a"] = sum(c.nbytes for c in counter.calls if c.op == "all_to_all_single")
    for ep, (case, topo, trainer) in built.items():
        out[ep]["param_bytes"] = sum(p.numel() * p.element_size() for s in trainer.parallel_model.stages
                                     for p in s.parameters())
        topo.destroy()
    counter.uninstall()
    return out


def expected_a2a(ep: int) -> int:
    """The dispatch rule's bytes per step, the mean over ranks (see the module docstring); 0 at ep 1 (no exchange).
    A rank sends its N·k rows and the count exchange's E int64s forward, back the R rows it received, and in the
    backward the gradients of both: R varies with the routing, its mean over the ranks is N·k."""
    if ep == 1:
        return 0
    case = ep_case(ep)
    mcfg = case.model_config()
    tokens = case.micro_batch_size * case.seq_len  # per micro-batch
    per_layer = 4 * tokens * mcfg.moe.top_k * mcfg.n_embd * 4 + mcfg.moe.n_experts * 8
    return per_layer * len(mcfg.moe_layers) * case.micro_batches


def ep_section(rounds: int) -> str:
    from helpers.distributed import run_world

    eps = [1, 2, 4]
    with preloaded_memhook():
        per_rank = run_world(4, measure_ep, eps, rounds, timeout=1800)
    rows = []
    base = [statistics.median(r[1]["times"]) for r in per_rank]
    for ep in eps:
        ratio = statistics.median(statistics.median(r[ep]["times"]) / b for r, b in zip(per_rank, base))
        sent = [r[ep]["a2a"] for r in per_rank]
        rows.append([ep, fmt_bytes(max(r[ep]["param_bytes"] for r in per_rank)),
                     f"{sum(sent) / len(sent):.0f} ({min(sent)}-{max(sent)})", expected_a2a(ep), f"{ratio:.2f}",
                     fmt_bytes(max(r[ep]["peak"] for r in per_rank))])
    mcfg = ep_case(1).model_config()
    return (f"qwen3-moe-tiny with {mcfg.moe.n_experts} experts (top {mcfg.moe.top_k}), dp 4, "
            f"{EP_MODEL['global_batch']}×{EP_MODEL['seq_len']} tokens a step, 2 micro-batches:\n\n" + table(
                rows, ["ep", "params/rank", "all-to-all bytes a step, mean over ranks (min-max)", "by the rule",
                       "step time / ep 1",
                       "step malloc peak (max rank)"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", nargs="+", default=["block", "ep"], choices=["block", "ep"])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--block-child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.block_child:
        block_memory_child(args.block_child)
        return 0
    sections = {"block": block_section, "ep": ep_section}
    for name in args.sections:
        print(sections[name](args.rounds))
        print()
    print(stamp("python bench/moe.py" + "".join(f" {a}" for a in (argv or sys.argv[1:]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
