"""Shared by the benchmarks and tests/test_plan.py: build a Trainer for one layout inside a spawned gloo world
(tests/helpers/distributed.run_world), feed it synthetic batches, and a few formatting helpers."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402


@dataclass(frozen=True)
class Case:
    """One layout of one model, as the trainer's flags spell it."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    micro_batches: int = 1
    # model and batch
    n_layer: int = 4
    n_embd: int = 64
    n_head: int = 4
    vocab: int = 512
    seq_len: int = 32
    global_batch: int = 8
    deepspeed_config: dict | str | None = field(default=None, hash=False, compare=False)  # ZeRO (trainer3d/zero/)
    extra: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def micro_batch_size(self) -> int:
        return self.global_batch // (self.dp * self.micro_batches)

    def label(self) -> str:
        s = f"({self.dp},{self.tp},{self.pp})" + (f" cp{self.cp}" if self.cp > 1 else "")
        if self.pp > 1:
            s += f" {self.schedule}" + (f" v{self.virtual_stages}" if self.virtual_stages > 1 else "")
        s += f" m{self.micro_batches}"
        if self.deepspeed_config:
            s += " " + zero_label(self.deepspeed_config)
        return s

    def train_config(self):
        from trainer3d.config import TrainConfig

        kw = dict(
            model="tiny", n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd, vocab_size=self.vocab,
            seq_len=self.seq_len, global_batch=self.global_batch, tp=self.tp, pp=self.pp, cp=self.cp, schedule=self.schedule,
            virtual_stages=self.virtual_stages, micro_batches=self.micro_batches, precision="fp32", seed=1234,
            lr=1e-3, warmup_steps=1, max_steps=1000, grad_clip=1.0, dropout=0.0,
        )
        if self.deepspeed_config:
            kw["deepspeed_config"] = self.deepspeed_config
        kw.update(self.extra)
        return TrainConfig(**kw)

    def model_config(self):
        return self.train_config().model_config(self.vocab)


def candidate_of(case: Case, zero_stage: int = 0, offload: bool = False):
    """The planner's Candidate for `case` (trainer3d/plan/candidate.py), as the trainer runs it: its bf16 without
    DeepSpeed is torch.autocast over fp32 parameters; ZeRO `offload` moves the optimizer (and, at stage 3, the
    parameters) to the host."""
    from trainer3d.plan.candidate import Candidate

    return Candidate(
        cfg=case.model_config(), dp=case.dp, tp=case.tp, pp=case.pp, cp=case.cp, schedule=case.schedule,
        virtual_stages=case.virtual_stages, micro_batches=case.micro_batches, micro_batch_size=case.micro_batch_size,
        seq_len=case.seq_len, precision="bf16-autocast" if case.extra.get("precision") == "bf16" else "fp32",
        zero_stage=zero_stage, offload_optimizer=offload, offload_params=offload and zero_stage == 3,
        sequence_parallel=bool(case.extra.get("sequence_parallel")), recompute=case.extra.get("recompute") == "full",
        ep=case.extra.get("ep", 1),
    )


def zero_label(ds) -> str:
    if isinstance(ds, str):
        return os.path.splitext(os.path.basename(ds))[0]
    z = ds.get("zero_optimization", {})
    off = [k.split("_")[1] for k in ("offload_optimizer", "offload_param") if (z.get(k) or {}).get("device", "none") != "none"]
    return f"zero{z.get('stage', 0)}" + ("+off(" + ",".join(off) + ")" if off else "")


def zero_available() -> bool:
    """DeepSpeed is installed, so the ZeRO engine (trainer3d/zero/) can run."""
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def build_trainer(case: Case):
    """Collective over the whole world (group creation); returns (topo, trainer or None on idle ranks)."""
    from trainer3d.train.setup import validate
    from trainer3d.train.trainer import Trainer

    cfg = case.train_config()
    setup = validate(cfg, case.world, case.vocab)
    topo = setup.topology(list(range(case.world)))
    trainer = None
    if topo.active:
        trainer = Trainer(setup, topo, torch.device("cpu"), cfg.model_config(case.vocab))
    return topo, trainer


def local_batch(case: Case, topo, step: int) -> torch.Tensor:
    """This dp rank's rows of a deterministic synthetic global batch."""
    g = torch.Generator().manual_seed(1000 + step)
    full = torch.randint(0, case.vocab, (case.global_batch, case.seq_len + 1), generator=g)
    per = case.global_batch // case.dp
    return full[topo.dp_rank * per : (topo.dp_rank + 1) * per]


def world_barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def rotated(names: list, r: int) -> list:
    """Round r of an interleaved comparison: every variant once, starting one further each round, so that none
    always runs first and the noise of a shared machine hits all alike."""
    k = r % len(names)
    return names[k:] + names[:k]


def time_rotated(passes: dict, rounds: int, base: str, before=None) -> dict:
    """{name: (median seconds, median of per-round ratios to `base`)} of `passes` (name -> a callable), every one run
    once a round in rotated order after a warm-up round; `before(name)` runs untimed before each."""
    import statistics

    names, times = list(passes), {k: [] for k in passes}
    for i in range(rounds + 1):
        for k in rotated(names, i):
            if before is not None:
                before(k)
            t0 = time.perf_counter()
            passes[k]()
            if i:  # the first round warms up
                times[k].append(time.perf_counter() - t0)
    return {k: (statistics.median(v), statistics.median(t / b for t, b in zip(v, times[base])))
            for k, v in times.items()}


def print_malloc_peak(run, repeats: int = 3) -> None:
    """Print {"peak": bytes} as JSON: the malloc peak over `repeats` calls of `run` above what was held before (a
    child under bench/memhook.c: measure.run_under_memhook reads it, with the process's VmHWM from outside)."""
    import json

    from bench.measure import MallocCounter

    counter = MallocCounter()
    counter.reset_peak()
    base = counter.current()
    for _ in range(repeats):
        run()
    print(json.dumps({"peak": counter.peak() - base}))


def lengths_cli(doc: str, rounds: int, make_pass):
    """The command line of a bench that times sides at several lengths: --rounds, and --child SIDE TOKENS, which
    prints that pass's malloc peak (its own process, for `length_rows`) and returns None; else the parsed args, one
    thread."""
    import argparse

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.child:
        return print_malloc_peak(make_pass(args.child[0], int(args.child[1])))
    return args


def length_rows(script: str, make_pass, sides, lengths, rounds: int, base: str) -> list[list]:
    """[tokens, side, ms, time / base, malloc peak, RSS high-water] for `make_pass(side, tokens)` at each length: the
    sides timed in this process, rotated each round; each one's memory in its own (`script --child side tokens`)."""
    from bench.measure import run_under_memhook

    rows = []
    for tokens in lengths:
        t = time_rotated({side: make_pass(side, tokens) for side in sides}, rounds, base)
        for side in sides:
            mem = run_under_memhook([sys.executable, os.path.abspath(script), "--child", side, str(tokens)], ROOT)
            rows.append([tokens, side, f"{t[side][0] * 1e3:.0f}", f"{t[side][1]:.2f}", fmt_bytes(mem["peak"]),
                         fmt_bytes(mem["hwm"])])
    return rows


def table(rows: list[list], header: list[str]) -> str:
    cols = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cols) for i in range(len(header))]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cols[1:]:
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
    return "\n".join(lines)


def stamp(cmd: str) -> str:
    import platform

    return (
        f"date: {time.strftime('%Y-%m-%d %H:%M %Z')}; machine: {platform.machine()} {os.cpu_count()} cores "
        f"(shared), torch {torch.__version__}; command: `{cmd}`"
    )
