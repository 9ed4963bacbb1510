"""The GPU round (bench/gpu_round.sh) in its dry mode: every part on CPU at tiny sizes, so that the script a lent GPU
session runs unattended cannot rot between the sessions that have a GPU. Its Python commands fork from one process
that has imported the trainer (bench/preloaded.py), as the same scripts and modules run as `__main__`.

Each part must finish ok, and where both sides of a comparison run on this CPU in fp32 the round must find them
equal: the "GPU" and CPU fp32 runs, the recomputed run, the resumed steps with FP8 on (the round's comparisons are
live, not printed constants). The MFU part writes its JSON rows with the fields bench/gpu_round.md reads.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from helpers.ds_ops import require_ops

REPO = Path(__file__).resolve().parent.parent
PARTS = ["env", "smoke", "paths: bf16 eager", "paths: fp32 GPU vs CPU", "paths: compile", "paths: recompute",
         "paths: save -> resume", "paths: export -> init-from-hf", "paths: ZeRO-1", "paths: ZeRO-3",
         "paths: document mask (flex)", "paths: Qwen3-MoE tiny", "paths: DeepSeek-V3 tiny", "paths: fp8 rowwise",
         "paths: fp8 tensorwise", "paths: DPO", "paths: engine (GRPO)", "fp8", "mfu",
         "big: recompute full", "big: LoRA r16, recompute full", "big: ZeRO-3 + CPU offload (the planner's JSON)",
         "engine", "lora"]


def _summary(out: Path) -> dict[str, tuple[str, str]]:
    rows = {}
    for line in (out / "summary.md").read_text().splitlines()[2:]:
        part, status, _seconds, finding = [c.strip() for c in line.strip("|").split(" | ", 3)]
        rows[part] = (status, finding)
    return rows


@pytest.mark.timeout(1500)  # the round's 720 s, after the ops build where no test before it built them
def test_dry_round_runs_every_part_and_compares(tmp_path):
    require_ops()  # its ZeRO paths load the checkout's ops (built by whichever test needs them first)
    out = tmp_path / "out"
    env = {**os.environ, "GPU_ROUND_DRY": "1", "OUT": str(out)}
    p = subprocess.run(["bash", "bench/gpu_round.sh", "--budget-s", "540"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=720)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = _summary(out)
    assert sorted(rows) == sorted(PARTS), rows.keys()
    bad = {k: v for k, v in rows.items() if v[0] != "ok"}
    assert not bad, f"{bad}\n{(out / 'round.log').read_text()[-4000:]}"
    for part in ("paths: fp32 GPU vs CPU", "paths: recompute", "paths: save -> resume"):
        diffs = [float(x) for x in re.findall(r"Δ\w+ (?:vs [\w ]+ )?([0-9.e+-]+)", rows[part][1])]
        assert diffs and all(d == 0.0 for d in diffs), (part, rows[part][1])
    assert "with --fp8 rowwise" in rows["paths: save -> resume"][1]  # FP8's resume is exact too
    for recipe in ("rowwise", "tensorwise"):  # the banner's count: tiny's 4 blocks, the middle two's 4 linears each
        assert rows[f"paths: fp8 {recipe}"][1].startswith(f"{recipe}: 8 linears in blocks 1-2"), rows
    losses = re.search(r"last steps ([0-9.]+) -> ([0-9.]+) with --fp8 tensorwise", rows["fp8"][1])
    bf16, fp8 = float(losses.group(1)), float(losses.group(2))  # FP8 changes the loss, by less than the 1%
    assert bf16 != fp8 and abs(fp8 / bf16 - 1) < 0.01, rows["fp8"]
    assert rows["paths: DPO"][1].startswith("--objective dpo: loss 0.693147"), rows["paths: DPO"]  # ln 2: ref = policy
    kl = float(re.search(r"KL [^0-9]* ([0-9.e+-]+);", rows["paths: engine (GRPO)"][1]).group(1))
    assert kl < 1e-6, rows["paths: engine (GRPO)"]  # the streamed weights are the engine's
    assert rows["engine"][1].count("same log-probs yes") == 3, rows["engine"]  # offload -> onload at DDP, ZeRO-1, 3
    assert "torch" in (out / "env.txt").read_text()
    mfu = json.loads((out / "gpu_mfu.json").read_text())
    assert [r["label"] for r in mfu] == ["tiny trainer", "tiny trainer-compile", "tiny bare-compile",
                                         "tiny bare-fp8-rowwise", "tiny trainer-fp8-rowwise"]
    for r in mfu:
        assert r["tokens_per_s"] > 0 and r["device"] == "cpu" and r["torch"].startswith("2.")
        assert {"model", "micro_batch", "compiled", "fp8", "mfu", "peak_mem_bytes"} <= r.keys()
    assert [r["fp8"] for r in mfu] == [None, None, None, "rowwise", "rowwise"]
    assert re.search(r"step phases: a [0-9.]+ ms step", rows["mfu"][1]), rows["mfu"]  # bench/step_phases.py ran
    assert "| read_scalars (the step's one device read) |" in (out / "phases.txt").read_text()
