"""One device-to-host read per training step (issue 6): Trainer.train_step at (1,1,1) reads the device exactly once
from trainer3d code, under DDP (fp32, and fp16 with its loss scale and skip check) and under ZeRO stages (1, 3,
and 3 with the optimizer offloaded, whose norm comes from DeepSpeed's per-partition norms).

A CPU run has no device sync to count, so the test counts what would be one on an accelerator: the tensor methods
that copy a value to the host (item, tolist, cpu, numpy, and float()/int()/bool()/index of a tensor) called directly
from a file of the trainer3d package during one train_step (the second: the first also builds lazy state). The one
read is parallel/engine.py's read_scalars. DeepSpeed's own reads inside engine.step() are its own and not counted.
A write of a host number into a tensor (`t[i] = 1.0`) is counted too: on CUDA it copies from pageable memory and
waits for the stream (torch.cuda.set_sync_debug_mode found two in _run_schedule, which stalled every GPU step until
its backward had run: bench/gpu_round.md's fifth round); host numbers go over in one queued copy (host_values).
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch

from helpers.distributed import run_world
from helpers.parity import MOE_BALANCED, VOCAB, global_batches, parity_config

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "trainer3d") + os.sep
READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__", "__setitem__")


@contextlib.contextmanager
def count_reads():
    """Yields a list that collects 'file:line function' for every host read called from trainer3d code."""
    calls: list[str] = []
    saved = {name: torch.Tensor.__dict__.get(name) for name in READS}

    def wrap(name):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, **kwargs):
            caller = sys._getframe(1).f_code
            # a tensor written into a tensor stays on the device; a host number does not
            on_device = name == "__setitem__" and not isinstance(args[1], (int, float, bool))
            if not on_device and caller.co_filename.startswith(PACKAGE):
                calls.append(f"{os.path.relpath(caller.co_filename, PACKAGE)}:{caller.co_name} .{name}")
            return original(self, *args, **kwargs)

        return counted

    for name in READS:
        setattr(torch.Tensor, name, wrap(name))
    try:
        yield calls
    finally:
        for name, value in saved.items():
            if value is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, value)


def _reads_per_step(rank: int, world_size: int, cases: dict) -> dict:
    from trainer3d.train.setup import validate
    from trainer3d.train.trainer import Trainer

    out = {}
    for name, kw in cases.items():
        cfg = parity_config(n_layer=2, **kw)
        setup = validate(cfg, 1, VOCAB)
        topo = setup.topology([0])
        trainer = Trainer(setup, topo, torch.device("cpu"), cfg.model_config(VOCAB))
        first, second = global_batches(2)
        trainer.train_step(first)
        with count_reads() as calls:
            record = trainer.train_step(second)
        out[name] = {"calls": calls, "record": record}
        topo.destroy()
    return out


def _ds(stage: int, offload: str = "none") -> dict:
    from test_zero import ds_config

    return ds_config(stage, offload)


def test_count_reads_sees_a_read():
    """The counter itself: a read (or a host number's write) from trainer3d code is seen, one from here is not."""
    from trainer3d.parallel import engine

    with count_reads() as calls:
        assert engine.read_scalars(torch.tensor(2.0), torch.tensor(3.0, dtype=torch.float64)) == [2.0, 3.0]
        torch.tensor(1.0).item()
        # code that claims to be engine.py's: a number written into a tensor counts, a tensor does not
        exec(compile("t = torch.zeros(2); t[0] = 1.0; t[1] = torch.tensor(2.0)", engine.__file__, "exec"),
             {"torch": torch})
    assert calls == ["parallel/engine.py:read_scalars .tolist", "parallel/engine.py:<module> .__setitem__"]


def test_one_read_per_train_step_ddp():
    """... and a mixture of experts (balancing losses, capacity): the step's routing statistics are read once more,
    together (parallel/moe_balance.py's end_step); the experts' grouped matmul reads nothing, and the capacity reads
    the rows it keeps once a layer and micro-batch (models/moe.py's dispatch: here one MoE layer, one micro-batch;
    tests/test_moe_reads.py counts a layer's reads inside the ops too)."""
    cases = {"ddp-fp32": {}, "ddp-fp16": {"precision": "fp16"}, "moe": dict(MOE_BALANCED, moe_capacity_factor=1.5)}
    results = run_world(1, _reads_per_step, cases, timeout=300)[0]
    for name, r in results.items():
        print(f"\n{name}: {r['calls']}")
        expected = ["parallel/engine.py:read_scalars .tolist"]
        if name == "moe":
            expected = ["models/moe.py:dispatch .tolist", *expected, "parallel/moe_balance.py:end_step .tolist"]
        assert r["calls"] == expected, f"{name}: {r['calls']}"
        assert r["record"]["loss"] > 0 and r["record"]["grad_norm"] > 0
    assert results["ddp-fp16"]["record"]["skipped"] is False
    moe = results["moe"]["record"]
    assert moe["moe_aux_loss"] > 0 and moe["moe_z_loss"] > 0 and 0 <= moe["moe_dropped_fraction"] < 1


def test_one_read_per_train_step_zero():
    from helpers.ds_ops import require_ops

    require_ops()
    cases = {"zero1": {"deepspeed_config": _ds(1)}, "zero3": {"deepspeed_config": _ds(3)},
             "zero3-offload-opt": {"deepspeed_config": _ds(3, "opt")}}
    results = run_world(1, _reads_per_step, cases, timeout=600)[0]
    for name, r in results.items():
        print(f"\n{name}: {r['calls']}")
        assert r["calls"] == ["parallel/engine.py:read_scalars .tolist"], f"{name}: {r['calls']}"
        assert r["record"]["loss"] > 0 and r["record"]["grad_norm"] > 0


def _reads_and_collectives(rank: int, world_size: int, cases: list) -> list:
    """Per case: this rank's host reads from trainer3d code and its collectives and sends by group (bench/measure.py's
    counter, DDP's bucket all-reduce routed through Python), in one train_step (the second)."""
    from collections import Counter

    from bench.harness import build_trainer, local_batch
    from bench.measure import CommCounter, group_namer

    counter = CommCounter().install()
    out = []
    for case in cases:
        topo, trainer = build_trainer(case)
        result = None
        if trainer is not None:
            CommCounter.count_ddp(trainer.engine.stage_modules)
            trainer.train_step(local_batch(case, topo, 0))
            counter.reset()
            counter.enabled = True
            with count_reads() as reads:
                trainer.train_step(local_batch(case, topo, 1))
            counter.enabled = False
            name_of = group_namer(topo)
            calls = Counter(name_of(c) for c in counter.calls if c.op not in ("recv", "irecv"))
            result = {"reads": reads, "calls": dict(calls), "pp_rank": topo.pp_rank}
        topo.destroy()
        out.append(result)
    counter.uninstall()
    return out


def test_a_step_makes_only_the_collectives_its_layout_needs():
    """One process makes no collective and one host read; at 8 processes (dp 2 × tp 2 × pp 2, and tp 2 × cp 2 × pp 2
    with sequence parallelism) every rank still reads the host once, makes one world all-reduce (the loss with the
    stop requests: no barrier of its own) and one model-parallel one (the norm), and in every other group exactly
    the calls the planner's analytic count says the layout needs (trainer3d/plan/comm.py)."""
    from bench.harness import Case, candidate_of
    from trainer3d.plan.comm import analytic_comm

    model = dict(n_layer=4, n_embd=64, n_head=4, vocab=512, seq_len=32)
    cases = [Case(global_batch=8, **model), Case(dp=2, tp=2, pp=2, micro_batches=4, global_batch=16, **model),
             Case(tp=2, cp=2, pp=2, micro_batches=4, global_batch=8, extra={"sequence_parallel": True}, **model)]
    results = run_world(8, _reads_and_collectives, cases, timeout=600)
    one = results[0][0]
    assert one["reads"] == ["parallel/engine.py:read_scalars .tolist"] and one["calls"] == {}
    for i, case in enumerate(cases[1:], start=1):
        for r in (res[i] for res in results):
            assert r["reads"] == ["parallel/engine.py:read_scalars .tolist"], r["reads"]
            expected = {}
            for t in analytic_comm(candidate_of(case), r["pp_rank"]):
                expected[t.group] = expected.get(t.group, 0) + t.calls
            assert r["calls"].get("world") == 1 and r["calls"].get("mp") == 1, r["calls"]
            assert r["calls"] == expected, (case.label(), r["pp_rank"], r["calls"], expected)
