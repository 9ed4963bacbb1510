"""A step whose loss or gradient norm is not finite is never applied. By default the run stops with one sentence
naming the step, on every rank alike (the norm and the loss are reduced over the world, so a NaN on one tp shard
stops both tp ranks), keeping the weights, the optimizer state and the checkpoints of the step before;
`--on-nonfinite skip` trains past it. End to end: a diverging run (--lr 1e20) exits 2 with that sentence and its
last checkpoint is the last finite step's, also under --keep-last 1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.distributed import free_port, launch_env, run_world
from helpers.ds_ops import require_ops
from helpers.parity import VOCAB, global_batches, parity_config
from trainer3d.zero import ops as zero_ops

ROOT = Path(__file__).resolve().parents[1]


def _poisoned_step(rank, world_size, policy: str) -> dict:
    """Two tp ranks: a step, then NaN in one element of tp rank 1's shard of a block weight, then a step."""
    from trainer3d.errors import TrainingError
    from trainer3d.train.setup import validate
    from trainer3d.train.trainer import Trainer

    cfg = parity_config(n_layer=2, tp=2, on_nonfinite=policy, adam_eps=3e-7)
    setup = validate(cfg, 2, VOCAB)
    trainer = Trainer(setup, setup.topology(), torch.device("cpu"), cfg.model_config(VOCAB))
    first, second = global_batches(2)
    trainer.train_step(first)
    stage = trainer.parallel_model.stages[0]
    params = dict(stage.named_parameters())
    sharded = next(p for n, p in params.items() if n.startswith(stage.BLOCKS) and getattr(p, "tp_spec", None))
    if trainer.topo.tp_rank == 1:
        with torch.no_grad():
            sharded.view(-1)[0] = float("nan")
    before = {n: p.detach().clone() for n, p in params.items()}
    moments = {n: s["exp_avg"].clone() for n, s in ((n, trainer.engine.optimizer.state[p]) for n, p in params.items())}
    try:
        outcome = {"record": trainer.train_step(second)}
    except TrainingError as e:
        outcome = {"error": str(e)}
    same = lambda a, b: torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)  # noqa: E731
    outcome["weights_unchanged"] = all(same(before[n], p.detach()) for n, p in params.items())
    outcome["moments_unchanged"] = all(same(moments[n], trainer.engine.optimizer.state[p]["exp_avg"])
                                       for n, p in params.items())
    outcome["step"] = trainer.step
    outcome["eps"] = {g["eps"] for g in trainer.engine.optimizer.param_groups}  # --adam-eps reaches AdamW
    return outcome


def test_a_nan_on_one_shard_stops_every_rank_with_the_same_sentence():
    results = run_world(2, _poisoned_step, "stop", timeout=240)
    assert results[0]["error"] == results[1]["error"]
    assert results[0]["error"].startswith("Step 2 has a loss of nan and a gradient norm of nan, so it was not applied "
                                          "and the run stops with the weights and checkpoints of step 1")
    assert all(r["weights_unchanged"] and r["moments_unchanged"] and r["step"] == 1 for r in results)


def test_skip_trains_past_a_nonfinite_step():
    results = run_world(2, _poisoned_step, "skip", timeout=240)
    for r in results:
        assert "error" not in r and r["record"]["skipped"] is True and r["step"] == 2 and r["eps"] == {3e-7}
        assert r["weights_unchanged"] and r["moments_unchanged"]


@pytest.mark.parametrize("engine", ["ddp", "zero3"])
def test_a_diverging_run_exits_2_and_keeps_its_last_finite_checkpoint(tmp_path, engine):
    """One process under DDP, and two under DeepSpeed ZeRO-3 (started as a launcher starts them, so that each one's
    exit code is seen; --on-nonfinite skip is refused there: test_cli): every process exits 2, one sentence, no
    traceback."""
    out = tmp_path / "run"
    env = launch_env()
    # AdamW's first update moves every weight by about the learning rate: 1e20 overflows the next forward pass
    cmd = [sys.executable, str(ROOT / "launch" / "train_gpt2.py"), "--model", "tiny", "--n-layer", "2", "--seq-len",
           "32", "--global-batch", "4", "--lr", "1e20", "--warmup-steps", "0", "--max-steps", "6", "--save-every", "1",
           "--keep-last", "1", "--out-dir", str(out)]
    envs = [env]
    if engine == "zero3":
        require_ops()
        cmd += ["--deepspeed_config", str(ROOT / "ds_configs" / "zero3.json")]
        port = str(free_port())
        envs = [dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                     TORCH_EXTENSIONS_DIR=zero_ops.default_extensions_dir()) for r in range(2)]
    procs = [subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(ROOT))
             for e in envs]
    outputs = [p.communicate(timeout=300) for p in procs]
    stderr = outputs[0][1]
    assert [p.returncode for p in procs] == [2] * len(procs), [o[1][-3000:] for o in outputs]
    errors = [line for line in stderr.splitlines() if line.startswith("trainer3d: error:")]
    assert len(errors) == 1 and errors[0].startswith("trainer3d: error: Step 2 has a loss of nan"), stderr[-3000:]
    assert all("Traceback" not in o[1] for o in outputs), stderr[-3000:]
    checkpoints = out / "checkpoints"
    assert sorted(d.name for d in checkpoints.iterdir() if d.is_dir()) == ["step_000001"]
    assert (checkpoints / "latest").read_text().strip() == "step_000001"
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1]  # the non-finite step is not recorded as trained
