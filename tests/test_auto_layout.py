"""--layout auto (trainer3d/plan/auto.py) and the stragglers' step times (trainer3d/train/stragglers.py), in one
process: the pick is a pure, fast function of its inputs that keeps the flags given; what cannot be planned is
refused with one sentence; ZeRO is planned only when asked for; the entry point prints the pick and records it in
meta.json, the W&B config and metrics.jsonl; the straggler rule names a rank after N slow intervals running.

Every tiny preset's pick at --tp 2 trains a step in a world of 2 and of 4 (two worlds of their own); the
other multi-process proofs ride in worlds that already spawn: the pick at 4 and 8 processes against the one-process
run and a slowed rank named (tests/test_parity.py), a run saved at world 4 resumed at world 2
(tests/test_checkpoint.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from types import SimpleNamespace

import pytest
import torch

from trainer3d.config import TrainConfig, parse_args
from trainer3d.errors import ConfigError
from trainer3d.plan.auto import Machine, choice_lines, read_machine, resolve_auto
from trainer3d.train.stragglers import StragglerWatch, WorkClock

PARITY = dict(model="tiny", n_layer=8, n_head=8, n_embd=64, vocab_size=500, seq_len=32, global_batch=16,
              precision="fp32", layout="auto")


def _machine(world: int, memory_gib: float = 4.0, per_node: int | None = None) -> Machine:
    return Machine(world, per_node or world, "cpu", memory_gib, None, 64.0, "cpu")


def _pick(world: int, machine: Machine | None = None, **flags) -> TrainConfig:
    cfg = TrainConfig(**{**PARITY, **flags})
    return resolve_auto(cfg, cfg.model_config(500), machine or _machine(world))


def test_the_pick_is_deterministic_fast_and_keeps_the_flags_given():
    t0 = time.perf_counter()
    free = _pick(8)
    assert time.perf_counter() - t0 < 1.0
    assert free == _pick(8) and free.layout_choice == _pick(8).layout_choice  # every rank picks alike
    assert (free.tp, free.pp) == (1, 1) and free.layout_choice["pick"].startswith("dp8 ")
    assert free.layout_choice["runner_up"] and "fastest of" in free.layout_choice["why"]
    tp2 = _pick(8, tp=2)
    assert tp2.tp == 2 and tp2.sequence_parallel and tp2.layout_choice["constraints"] == {"tp": 2}
    pp2 = _pick(8, pp=2, schedule="gpipe", recompute="full")
    assert (pp2.pp, pp2.schedule, pp2.recompute) == (2, "gpipe", "full")
    assert 16 % (pp2.micro_batches * 8 // (pp2.tp * pp2.pp)) == 0  # the global batch splits over dp × micro-batches
    assert _pick(4, micro_batches=2).micro_batches == 2
    # from the command line, a flag typed at its default value is a constraint too
    typed = parse_args(["--layout", "auto", "--tp", "1", "--model", "tiny", "--n-layer", "8", "--n-head", "8",
                        "--n-embd", "64", "--vocab-size", "500", "--seq-len", "32", "--global-batch", "16"])
    assert resolve_auto(typed, typed.model_config(500), _machine(8)).layout_choice["constraints"] == {"tp": 1}
    # a node's ranks: tp stays inside one (2 nodes of 2: tp 4 would cross the network)
    two_nodes = _pick(4, _machine(4, per_node=2), tp=2)
    assert two_nodes.layout_choice["machine"]["nodes"] == 2
    with pytest.raises(ConfigError):
        _pick(4, _machine(4, per_node=2), tp=4)


def test_what_cannot_be_planned_is_refused_with_one_sentence():
    with pytest.raises(ConfigError) as e:
        _pick(4, _machine(4, memory_gib=0.001))
    text = str(e.value)
    assert text.startswith("--layout auto finds no layout of 4 processes for this ") and "0.001 GiB per rank" in text
    assert not re.search(r"\.\s+[A-Z]", text) and "\n" not in text  # one sentence
    assert "does not fit in GPU memory" in text and "--device-memory-gib" in text and text.endswith(".")
    with pytest.raises(ConfigError) as e:
        _pick(4, micro_batches=3)
    assert "that keeps --micro-batches 3 (" in str(e.value) and "drop or change those flags" in str(e.value)


def test_zero_is_planned_only_when_asked_for():
    """GPT-2 small (124M, fp32 on CPU: 16 bytes of state a parameter, ~2 GiB) on 8 ranks of 1.5 GiB at --tp 1 --pp 1:
    DDP cannot fit, ZeRO can. Without --deepspeed_config auto nothing fits; with it the pick is a ZeRO stage and its
    JSON."""
    cfg = TrainConfig(model="gpt2", seq_len=128, global_batch=16, precision="fp32", layout="auto",
                      explicit_flags=("layout", "tp", "pp", "model", "seq_len", "global_batch", "precision"))
    mcfg, small = cfg.model_config(50257), _machine(8, memory_gib=1.5)
    with pytest.raises(ConfigError):
        resolve_auto(cfg, mcfg, small)
    z = resolve_auto(dataclasses.replace(cfg, deepspeed_config="auto"), mcfg, small)
    ds = z.deepspeed_config
    assert ds["zero_optimization"]["stage"] >= 1 and ds["bf16"] == {"enabled": False}
    assert ds["train_batch_size"] == 16 and f"ZeRO-{ds['zero_optimization']['stage']}" in z.layout_choice["pick"]
    # a JSON of the user's with "zero_optimization": "auto": that section planned, the rest kept
    own = resolve_auto(dataclasses.replace(cfg, deepspeed_config={"zero_optimization": "auto", "steps_per_print": 7}),
                       mcfg, small)
    assert own.deepspeed_config["steps_per_print"] == 7 and own.deepspeed_config["zero_optimization"]["stage"] >= 1


def test_machine_from_the_launcher():
    assert read_machine(8, environ={"LOCAL_WORLD_SIZE": "4"}).ranks_per_node == 4
    assert read_machine(8, environ={"SLURM_NTASKS_PER_NODE": "2(x4)"}).ranks_per_node == 2
    m = read_machine(4, environ={}, memory_gib=3.0)
    assert (m.ranks_per_node, m.memory_gib, m.device) == (4, 3.0, "cpu")


def test_the_entry_point_prints_and_records_the_pick(tmp_path, monkeypatch, capsys):
    from trainer3d.train.loop import main
    from trainer3d.train.tracking import run_config

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    out = tmp_path / "run"
    assert main(["--layout", "auto", "--model", "tiny", "--n-layer", "2", "--seq-len", "32", "--global-batch", "4",
                 "--max-steps", "2", "--eval-every", "0", "--log-every", "1", "--out-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "[trainer3d] --layout auto on 1 node(s) × 1 cpu ranks" in printed and "  why: fastest of" in printed
    meta = json.loads((out / "checkpoints" / "step_000002" / "meta.json").read_text())
    choice = meta["config"]["layout_choice"]
    assert choice["pick"].startswith("dp1 tp1 pp1") and choice["machine"]["world"] == 1
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["step_time_min"] == r["step_time_median"] == r["step_time_max"] > 0 for r in records if "loss" in r)
    assert not any("rank_step_times" in r for r in records)
    cfg = TrainConfig(layout="auto", layout_choice=choice)
    layout = SimpleNamespace(dp=1, tp=1, pp=1, cp=1, world_size=1)
    trainer = SimpleNamespace(cfg=cfg, topo=SimpleNamespace(layout=layout),
                              mcfg=cfg.model_config(50257), device="cpu", precision="fp32", deepspeed=None,
                              plan=SimpleNamespace(global_batch=4, micro_batches=1, micro_batch_size=4),
                              parallel_model=SimpleNamespace(n_stages=1, layer_ranges=[range(0, 2)]))
    assert run_config(trainer)["layout"]["auto"] == choice  # the W&B config
    assert choice_lines(choice)[0].startswith("--layout auto on 1 node(s)")


def test_a_straggler_is_named_after_n_slow_intervals_running():
    watch = StragglerWatch(1.2, 3, where=lambda r: f"pp0 dp{r}")
    slow = [0.1, 0.1, 0.13, 0.1]  # rank 2 at 1.3× the median
    named = []
    for times in [slow] * 4 + [[0.1] * 4] + [slow]:
        watch.add(times)
        report = watch.report()
        named.append(report.get("stragglers"))
    assert report["step_time_min"] == 0.1 and report["step_time_max"] == 0.13 and report["step_time_median"] == 0.1
    assert named[:2] == [None, None] and named[2] == named[3] == {"rank2": pytest.approx(1.3)}
    assert named[4] is None and named[5] is None  # a fast interval ends the run of slow ones
    watch = StragglerWatch(1.2, 1, where=lambda r: f"pp0 dp{r}")
    watch.add(slow)
    watch.report()
    assert watch.lines() == ["straggler: rank 2 (pp0 dp2) took 1.30× the median step time (130.0 ms vs 100.0 ms) "
                             "for 1 consecutive logging intervals"]


def test_the_work_clock_counts_training_forwards_only():
    stage = torch.nn.Linear(4, 4)
    clock = WorkClock([stage], torch.device("cpu"))
    stage.register_forward_pre_hook(lambda *_: time.sleep(0.02))  # after the clock's own: counted
    clock.begin(data_s=0.5)
    stage(torch.ones(1, 4))
    assert 0.52 <= clock.seconds() < 1.0
    stage(torch.ones(1, 4))  # an evaluation pass after the step's all-reduce: not counted
    clock.begin(data_s=0.0)
    assert clock.seconds() == 0.0


def test_the_work_clock_on_cuda_reports_the_previous_steps_events(monkeypatch):
    """On CUDA the forwards are timed by events and read one step late, when the step's own read has completed them
    (reading them sooner would be a device sync): checked here with a host-clock stand-in for torch.cuda.Event."""

    class Event:
        def __init__(self, enable_timing: bool):
            assert enable_timing
            self.t = None

        def record(self):
            self.t = time.perf_counter()

        def elapsed_time(self, end) -> float:  # milliseconds, as CUDA's
            return (end.t - self.t) * 1e3

    monkeypatch.setattr(torch.cuda, "Event", Event)
    stage = torch.nn.Linear(4, 4)
    clock = WorkClock([stage], torch.device("cuda"))
    pause = stage.register_forward_pre_hook(lambda *_: time.sleep(0.02))
    clock.begin(data_s=0.1)
    stage(torch.ones(1, 4))
    assert clock.seconds() == 0.1  # its own forward is not read yet
    pause.remove()
    clock.begin(data_s=0.0)
    stage(torch.ones(1, 4))
    assert 0.02 <= clock.seconds() < 0.5  # the previous step's forward


def test_ranks_that_planned_differently_are_refused_together(monkeypatch):
    """Mixed nodes: a rank that read another memory size picks another layout, and would build other process groups
    and hang in them; the one gather at launch finds it, and every rank raises the same sentence."""
    from trainer3d.plan import auto

    same, other = _pick(4).layout_choice, _pick(4, _machine(4, memory_gib=8.0, per_node=2), pp=2).layout_choice
    auto.agree_on_pick(same, None)  # one process: nothing to compare
    mine = lambda r: (r["pick"], round(r["machine"]["memory_gib"], 3), r["machine"]["ranks_per_node"], "cpu",  # noqa: E731
                      "none")
    monkeypatch.setattr(auto, "all_gather_object", lambda obj, group: [mine(same), mine(same), mine(other)])
    with pytest.raises(ConfigError) as e:
        auto.agree_on_pick(same, None)
    assert str(e.value).startswith(f"--layout auto planned {same['pick']} on rank 0 (4.0 GiB, 4 ranks a node, cpu, "
                                   f"calibrated none) but {other['pick']} on rank 2 (8.0 GiB, 2 ranks a node, cpu, "
                                   "calibrated none): the nodes differ")


def test_a_calibration_of_this_machine_replaces_the_nominal_constants(tmp_path, monkeypatch):
    """Where `python -m trainer3d.plan --calibrate` cached this kind of machine, --layout auto plans with its numbers
    and says so; a fast measured link moves the pick toward tensor parallelism, which the nominal constants avoid."""
    from trainer3d.plan import calibrate
    from trainer3d.plan.auto import choice_lines
    from trainer3d.train.setup import auto_machine

    monkeypatch.setenv("TRAINER3D_CALIBRATION", str(tmp_path))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    cfg = TrainConfig(**PARITY)
    assert auto_machine(cfg, 8).measured == {}
    fast_link = {op: calibrate.Link(1e-9, 1e4) for op in calibrate.OPS}
    fast = calibrate.Calibration(host="h", device=calibrate.device_name(torch.device("cpu")), ranks_per_node=8,
                                 nodes=1, dtype="fp32", matmul_tflops=1e-3, intra=fast_link, inter=None, overlap=0.0,
                                 ranks_per_processor=1.0, adam_params_per_s=7e10, seconds=1.0,
                                 date="2026-11-26 18:00 UTC")
    calibrate.save(fast, torch.device("cpu"))
    m = auto_machine(cfg, 8)
    assert m.measured == calibrate.constants(fast) and m.calibrated == fast.date
    nominal, measured = _pick(8), _pick(8, m)
    assert nominal.tp == 1 and measured.tp > 1, (nominal.layout_choice["pick"], measured.layout_choice["pick"])
    assert "calibrated on this machine 2026-11-26 18:00 UTC" in choice_lines(measured.layout_choice)[0]


TINY = dict(layout="auto", seq_len=64, global_batch=8, precision="fp32", out_dir="runs/unused")


def _train_each_pick(rank, world_size, runs):
    """One training step at each (preset, flags)'s pick, on random tokens: {(name, tp flag): (loss, the pick)}."""
    from trainer3d.checkpoint.load import apply, prepare
    from trainer3d.train.setup import validate
    from trainer3d.train.trainer import Trainer

    tokens = torch.randint(0, 512, (8, 65), generator=torch.Generator().manual_seed(0))
    out = {}
    for name, flags in runs:
        setup = validate(TrainConfig(model=name, **TINY, **flags), world_size, vocab_size=512,
                         machine=_machine(world_size))
        topo = setup.topology(list(range(world_size)))
        if topo.active:
            mcfg = setup.model_config(512)
            start = prepare(setup.cfg, mcfg, topo)
            trainer = Trainer(setup, topo, torch.device("cpu"), mcfg, shard_value=start.shard_value)
            apply(start, trainer)
            per = 8 // setup.layout.dp
            record = trainer.train_step(tokens[topo.dp_rank * per:(topo.dp_rank + 1) * per])
            if trainer.is_logging_rank:
                out[name, flags.get("tp")] = (record["loss"], setup.cfg.layout_choice["pick"])
        topo.destroy()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_the_pick_is_a_layout_the_model_runs(world):
    """Every tiny preset, free and at --tp 2: the pick passes every check of the run (train/setup.validate: the family's
    tp rule, experts over ep, DeepSeek Sparse Attention's layouts, ...), and the --tp 2 picks (sequence parallelism,
    experts over ep) train a step in a world of that size (a loss near ln 512). DSA's picks at --tp 2 have sequence
    parallelism too (until 2026-12-07 DSA ran without it, and its picks had none)."""
    from helpers.distributed import run_world
    from trainer3d.models import MODEL_PRESETS
    from trainer3d.train.setup import validate

    names = [n for n in MODEL_PRESETS if n.endswith("tiny")]
    for name in names:
        for flags in ({}, {"tp": 2}):
            picked = validate(TrainConfig(model=name, **{**TINY, **flags}), world, vocab_size=512,
                              machine=_machine(world)).cfg
            assert picked.tp == flags.get("tp", picked.tp), (name, flags)
            if name == "deepseek-v3.2-tiny" and flags:
                assert picked.sequence_parallel, picked.layout_choice["pick"]
    runs = [(name, {"tp": 2}) for name in names]  # (the free picks of these tiny models are all plain dp)
    trained = {k: v for r in run_world(world, _train_each_pick, runs, timeout=900) for k, v in r.items()}
    assert set(trained) == {(name, flags.get("tp")) for name, flags in runs}
    for (name, tp), (loss, pick) in trained.items():
        print(f"{name} {'--tp 2 ' if tp else ''}at {world}: {pick}, loss {loss:.3f}")
        assert abs(loss - math.log(512)) < 1.0, (name, pick, loss)


def test_the_last_stage_holds_the_logits_of_every_mtp_depth():
    """The planner's memory of DeepSeek-V3's last stage: one set of logits for the next token and one for each MTP
    depth (each [tokens, vocab/tp] until the backward), and the depth's block; a model without MTP holds one."""
    from trainer3d.models import MODEL_PRESETS
    from trainer3d.parallel.tensor_parallel import padded_vocab_size
    from trainer3d.plan.candidate import Candidate
    from trainer3d.plan.memory import layer_activation_bytes, stage_activation_bytes

    base = MODEL_PRESETS["deepseek-v3-tiny"]
    held = {}
    for depth in (0, 1, 2):
        cfg = dataclasses.replace(base, mtp_layers=depth)
        cand = Candidate(cfg=cfg, dp=1, tp=1, pp=1, cp=1, ep=1, schedule="1f1b", virtual_stages=1, micro_batches=1,
                         micro_batch_size=2, seq_len=64, precision="fp32")
        stage = SimpleNamespace(layers=cfg.n_layer, first=True, last=True, blocks=range(cfg.n_layer))
        held[depth] = stage_activation_bytes(cand, stage)
        logits = cand.tokens * padded_vocab_size(cfg.vocab_size, 1) * cand.prec.matmul
    per_depth = logits + layer_activation_bytes(cand)
    assert held[1] - held[0] == pytest.approx(per_depth) and held[2] - held[1] == pytest.approx(per_depth)
