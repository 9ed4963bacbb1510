"""The last pipeline stage's memory through one step, with and without freeing the logits after their backward.

torch's schedules keep the last forward's output in a local variable until the next forward; the loss works in the
logits' storage (their gradient lives there), so without pipeline._FreeLogitsAfterBackward a used logits-sized
gradient stays alive through the next micro-batch's head. For each layout, on the last stage's rank: the bytes
held (malloc counter) between one micro-batch's backward and the next one's forward, and the step's peak, both above
what the rank holds at the step's start without gradients; "kept" disables the free (the same trainer, the free
patched out), "freed" is the trainer as it is. Same model as bench/memory.py, fp32, 4 micro-batches.

    python bench/last_stage_memory.py
"""

from __future__ import annotations

import gc
import weakref
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness import Case, build_trainer, local_batch, stamp, table  # noqa: E402

LAYOUTS = ((1, "1f1b", 1), (2, "1f1b", 1), (2, "gpipe", 1), (2, "interleaved-1f1b", 2), (2, "interleaved-zb", 2))
STEPS = 3  # the last is measured (the first allocates Adam's state and the pipeline's buffers)
MiB = 2**20


def measure(rank: int, world: int, cases: list[tuple[str, int, bool]]) -> list:
    from bench.measure import MallocCounter
    from bench.memory import MODEL
    from trainer3d.parallel import pipeline

    mc = MallocCounter()
    out = []
    real_free = pipeline._free
    for pp, schedule, v, free in cases:
        pipeline._free = real_free if free else (lambda tensors: None)
        case = Case(pp=pp, micro_batches=4, schedule=schedule, virtual_stages=v, **MODEL)
        topo, tr = build_trainer(case)
        if tr is None:  # idle in this layout
            topo.destroy()
            continue
        stages = getattr(tr.schedule, "_stages", None) or [tr.schedule._stage]  # torch's PipelineStages of this rank
        stage = next((st for st in stages if st.is_last), None)
        made: list = []  # weak references to every logits tensor of the step
        used_alive: list[int] = []  # at each forward of the last stage: bytes of logits whose backward is done
        if stage is not None:
            def before(*args):
                in_use = {id(t) for out, _ in stage.fwd_cache.values() for t in out}
                in_use |= {id(t) for out in stage.logits_until_weight_pass.values() for t in out}
                alive = [w() for w in made if w() is not None and id(w()) not in in_use]
                used_alive.append(sum(t.untyped_storage().nbytes() for t in alive))

            stage.submod.register_forward_pre_hook(before)
            stage.submod.register_forward_hook(lambda m, a, out: made.append(weakref.ref(out)))
        for s in range(STEPS):
            gc.collect()
            made.clear()
            used_alive.clear()
            tr.engine.zero_grad()
            start = mc.current()
            mc.reset_peak()
            tr.train_step(local_batch(case, topo, s))
        if stage is not None:
            logits = case.micro_batch_size * case.seq_len * tr.parallel_model.padded_vocab * 4
            out.append(dict(pp=pp, schedule=schedule, v=v, free=free, logits=logits, used_alive=max(used_alive),
                            peak=mc.peak() - start))
        topo.destroy()
        del tr, topo
    return out


def run(layouts=LAYOUTS, timeout: float = 900) -> dict:
    """{(layout, freed): the last stage's measurement} over a 2-process world."""
    from bench.measure import preloaded_memhook

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from helpers.distributed import run_world

    cases = [(pp, s, v, free) for pp, s, v in layouts for free in (False, True)]
    with preloaded_memhook():
        per_rank = run_world(2, measure, cases, timeout=timeout)
    return {((r["pp"], r["schedule"], r["v"]), r["free"]): r for rank in per_rank for r in rank}


def main() -> int:
    by = run()
    out = []
    for pp, s, v in LAYOUTS:
        kept, freed = by[((pp, s, v), False)], by[((pp, s, v), True)]
        out.append([f"pp{pp} {s}" + (f" v{v}" if v > 1 else ""), kept["logits"], kept["used_alive"], freed["used_alive"],
                    kept["peak"], freed["peak"], kept["peak"] - freed["peak"]])
    header = ["layout", "one micro-batch's logits", "used logits alive at a forward, kept",
              "used logits alive at a forward, freed", "peak, kept", "peak, freed", "peak saved"]
    print("MiB on the last stage's rank, above the step's start without gradients")
    print(table([[r[0]] + [f"{x / MiB:.2f}" for x in r[1:]] for r in out], header))
    print(stamp("python bench/last_stage_memory.py"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
