"""W&B tracking, metrics and console output, and the profiler trace, from real (tiny) training runs.

One single-process run (offline W&B, --profile-steps, --peak-tflops) and one 2-process torchrun run (pp=2, so the
logging rank is rank 1, not rank 0) are shared by the tests below. The logged history is read back from the
`.wandb` file (trainer3d.tracking.read_history: wandb ships no reader) and compared with metrics.jsonl.
"""

from __future__ import annotations

import glob
import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.distributed import launch_env
from trainer3d.models import MODEL_PRESETS
from trainer3d.train.tracking import resolve_mode
from helpers.wandb_reader import read_config, read_history

ROOT = Path(__file__).resolve().parents[1]
ENTRY = str(ROOT / "launch" / "train_gpt2.py")
SECRET = "trainer3d-test-api-key-0123456789abcdef0123456789abcdef"  # a fake key: must never be written anywhere
TINY = ["--model", "tiny", "--n-layer", "2", "--seq-len", "32", "--global-batch", "4", "--log-every", "1"]
TRAIN_KEYS = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_bytes", "step_time_s")


def _env(tmp: Path) -> dict:
    (tmp / "wandb").mkdir(parents=True, exist_ok=True)
    return launch_env(WANDB_MODE="offline", WANDB_DIR=str(tmp / "wandb"), WANDB_API_KEY=SECRET)


def _run(cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
    assert p.returncode == 0, f"exit {p.returncode}\n--- stdout\n{p.stdout[-4000:]}\n--- stderr\n{p.stderr[-6000:]}"
    return p


def _wandb_files(wandb_dir: Path) -> list[str]:
    return sorted(glob.glob(str(wandb_dir / "wandb" / "offline-run-*" / "run-*.wandb")))


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wandb1")
    out = tmp / "run"
    cmd = [sys.executable, ENTRY, *TINY, "--max-steps", "6", "--eval-every", "3", "--out-dir", str(out),
           "--wandb-project", "trainer3d-test", "--wandb-run-name", "unit", "--profile-steps", "2:3",
           "--peak-tflops", "1.0"]
    p = _run(cmd, _env(tmp), timeout=300)
    return tmp, out, p


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wandb2")
    out, logs = tmp / "run", tmp / "logs"
    from helpers.distributed import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "0",
           "--master-port", str(free_port()), "--redirects", "3", "--log-dir", str(logs),
           ENTRY, *TINY, "--pp", "2", "--max-steps", "3", "--eval-every", "0", "--out-dir", str(out),
           "--wandb-project", "trainer3d-test", "--dist-timeout", "60", "--profile-steps", "2:2"]
    p = _run(cmd, _env(tmp), timeout=300)
    return tmp, out, logs, p


# ---- single process ------------------------------------------------------------------------------------------
def test_history_equals_metrics_jsonl(single):
    tmp, out, _ = single
    files = _wandb_files(tmp / "wandb")
    assert len(files) == 1, files
    history = {row["_step"]: row for row in read_history(files[0])}
    records = _metrics(out)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5, 6]
    for rec in records:
        row = history[rec["step"]]
        for key, value in rec.items():
            if key == "step" or value is None:
                continue
            assert row[key] == pytest.approx(value, rel=1e-12, abs=0), (rec["step"], key)
    for rec in records[1:]:
        for key in TRAIN_KEYS:
            assert rec.get(key) is not None, (rec["step"], key)
    assert [r["step"] for r in records if "val_loss" in r] == [0, 3, 6]


def test_config_logged(single):
    tmp, out, _ = single
    config = read_config(_wandb_files(tmp / "wandb")[0])
    assert config["train"]["max_steps"] == 6 and config["train"]["wandb_run_name"] == "unit"
    assert config["layout"] == {"dp": 1, "tp": 1, "pp": 1, "cp": 1, "world_size": 1, "schedule": "1f1b", "stages": 1,
                                "layers_per_stage": [2]}
    assert config["model"]["n_layer"] == 2 and config["model"]["n_params"] > 0
    assert config["batch"]["tokens_per_step"] == 4 * 32
    assert config["precision"] == "fp32" and config["device"] == "cpu"


def test_api_key_never_written(single):
    tmp, out, p = single
    assert SECRET not in p.stdout + p.stderr
    for path in tmp.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path


def test_console_progress_and_metrics(single):
    _, _, p = single
    console = p.stdout + p.stderr
    for step in range(1, 7):
        assert f"step {step:>6} | loss" in console
    line = next(x for x in console.splitlines() if "step      6 | loss" in x)
    for field in ("tok/s", "mfu", "GiB", "val_loss"):
        assert field in line, line
    bar = [x for x in console.replace("\r", "\n").splitlines() if "/6 [" in x]
    assert any("6/6" in x for x in bar) and all("<" in x for x in bar), bar  # tqdm: [elapsed<ETA, rate]


def test_profile_trace(single):
    _, out, _ = single
    path = out / "profile" / "rank0.pt.trace.json"
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    assert len(events) > 100
    names = {e.get("name") for e in events}
    assert {"ProfilerStep#2", "ProfilerStep#3"} <= names and "ProfilerStep#4" not in names
    assert any(str(n).startswith("aten::") for n in names)


def test_flops_per_token_is_megatrons():
    """Narayanan et al. 2021 (Megatron): 72·B·s·l·h²·(1 + s/6h + V/(12·h·l)) FLOPs per step without recomputation,
    i.e. per token 72·l·h² + 12·l·h·s + 6·V·h (PaLM's 6N + 12·L·H·Q·T). Ours also counts biases and LayerNorms."""
    for name in ("gpt2", "gpt2-medium"):
        cfg = MODEL_PRESETS[name]
        l, h, s, V = cfg.n_layer, cfg.n_embd, 1024, 50257
        cfg = type(cfg)(**{**cfg.__dict__, "vocab_size": V})
        megatron = 72 * l * h * h * (1 + s / (6 * h) + V / (12 * h * l))
        assert cfg.flops_per_token(s) == pytest.approx(megatron, rel=2e-3)


def test_config_carries_deepspeed_json(tmp_path):
    from types import SimpleNamespace

    from trainer3d.config import TrainConfig
    from trainer3d.distributed.topology import Layout
    from trainer3d.train.tracking import run_config

    ds = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 3}}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    cfg = TrainConfig(deepspeed_config=str(tmp_path / "ds.json"), n_layer=2)
    trainer = SimpleNamespace(
        cfg=cfg, topo=SimpleNamespace(layout=Layout(dp=2, tp=2, pp=2)), mcfg=cfg.model_config(50257), device="cpu",
        plan=SimpleNamespace(global_batch=8, micro_batches=4, micro_batch_size=1), precision="fp32",
        parallel_model=SimpleNamespace(n_stages=2, layer_ranges=[range(0, 1), range(1, 2)]),
        deepspeed=SimpleNamespace(ds_config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}),
    )
    config = run_config(trainer)
    assert config["deepspeed"] == ds and config["layout"]["world_size"] == 8
    assert config["deepspeed_resolved"]["train_micro_batch_size_per_gpu"] == 1  # "auto" as the engines got it
    assert json.loads(json.dumps(config)) == config  # all JSON: nothing wandb would have to pickle or drop
    assert not any("API_KEY" in k.upper() for k in json.dumps(config).split('"'))


def test_mode_resolution():
    assert resolve_mode(None, None, {}) == "disabled"
    assert resolve_mode(None, None, {"WANDB_MODE": "offline"}) == "disabled"  # no project: off
    assert resolve_mode("p", None, {}) == "online"
    assert resolve_mode(None, None, {"WANDB_PROJECT": "p", "WANDB_MODE": "offline"}) == "offline"
    assert resolve_mode("p", "disabled", {"WANDB_MODE": "online"}) == "disabled"
    assert resolve_mode(None, "offline", {}) == "offline"


# ---- two processes -------------------------------------------------------------------------------------------
def test_one_rank_logs(two_ranks):
    tmp, out, logs, _ = two_ranks
    runs = glob.glob(str(tmp / "wandb" / "wandb" / "offline-run-*"))
    assert len(runs) == 1, runs
    history = read_history(_wandb_files(tmp / "wandb")[0])
    assert [row["_step"] for row in history] == [1, 2, 3]
    assert [r["step"] for r in _metrics(out)] == [1, 2, 3]
    config = read_config(_wandb_files(tmp / "wandb")[0])
    assert config["layout"]["pp"] == 2 and config["layout"]["world_size"] == 2


def test_profile_trace_per_rank(two_ranks):
    _, out, _, _ = two_ranks
    for rank in (0, 1):
        names = {e.get("name") for e in json.loads((out / "profile" / f"rank{rank}.pt.trace.json").read_text())
                 ["traceEvents"]}
        assert "ProfilerStep#2" in names, rank


def test_non_logging_rank_is_quiet(two_ranks):
    """pp=2: the loss lives on the last stage, so rank 1 logs and rank 0 prints nothing (warnings aside)."""
    _, _, logs, _ = two_ranks
    per_rank = {}
    for rank in (0, 1):
        paths = glob.glob(str(logs / "**" / "attempt_0" / str(rank) / "*.log"), recursive=True)
        assert paths, list(logs.rglob("*"))
        per_rank[rank] = {Path(x).name: Path(x).read_text() for x in paths}
    assert "step      3 | loss" in per_rank[1]["stdout.log"] + per_rank[1]["stderr.log"]
    assert per_rank[0]["stdout.log"].strip() == "", per_rank[0]["stdout.log"]
    # torch's own warnings ("[rank0]:[W...") and the profiler's start/stop notes (this run has --profile-steps) aside
    noisy = [x for x in per_rank[0]["stderr.log"].splitlines()
             if x.strip() and "warn" not in x.lower() and "]:[W" not in x and not x.startswith("USDT:")]
    assert noisy == [], noisy
