"""`deepspeed launch/train_gpt2.py ...` as a user types it, on a host without GPUs.

DeepSpeed's runner finds no GPU here, but `--num_gpus N` still launches N local processes (there is no
`--num_procs`); each gets RANK/LOCAL_RANK/WORLD_SIZE/MASTER_* in its environment and `--local_rank=i` on its
command line, which the entry script accepts. The run uses ds_configs/zero3_offload.json unchanged (its "auto" precision follows --precision bf16,
ZeRO-3, optimizer and parameters offloaded to CPU) at tp=2 (so dp=2), and the test reads metrics.jsonl.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys


from helpers.distributed import free_port
from helpers.ds_ops import require_ops
from trainer3d.zero import ops as zero_ops

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = (
    "First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. First Citizen: You are all "
    "resolved rather to die than to famish? All: Resolved. resolved. First Citizen: First, you know Caius Marcius "
    "is chief enemy to the people. "
)


def test_deepspeed_launcher_zero3_offload(tmp_path):
    require_ops()
    data = tmp_path / "corpus.txt"
    data.write_text(TEXT * 60)
    out = tmp_path / "run"
    launcher = shutil.which("deepspeed")
    cmd = [launcher] if launcher else [sys.executable, "-m", "deepspeed.launcher.runner"]
    cmd += [
        "--num_gpus", "4", "--master_port", str(free_port()),
        "launch/train_gpt2.py", "--tp", "2", "--deepspeed_config", "ds_configs/zero3_offload.json", "--precision", "bf16",
        "--model", "tiny", "--n-layer", "2", "--seq-len", "32", "--global-batch", "8", "--max-steps", "3",
        "--warmup-steps", "1", "--eval-every", "0", "--eval-batches", "1", "--log-every", "1",
        "--data", str(data), "--out-dir", str(out),
    ]
    env = dict(
        os.environ, TRAINER3D_CACHE=str(tmp_path / "cache"),
        TORCH_EXTENSIONS_DIR=zero_ops.default_extensions_dir(), HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled",
    )
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=420)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    assert "memory at start (ZeRO-3)" in proc.stdout, tail  # the start-of-run memory line
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3], records
    for r in steps:
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0
        # ZeRO-3 + offload of both: parameters and optimizer states are reported as offloaded, in full
        assert r["param_offloaded_bytes"] == r["param_bytes"] > 0
        assert r["optim_offloaded_bytes"] == r["optim_bytes"] > 0
    assert steps[-1]["loss"] < steps[0]["loss"] + 0.5
