"""HellaSwag scoring and text samples (trainer3d/data/hellaswag.py, trainer3d/train/downstream.py, trainer3d.evaluate).

- The file: every malformed line fails with its line number; rows score the ending's tokens only.
- Scoring: a hand-set model that repeats the previous token (a large tied embedding, small random blocks) picks the
  endings a hand-made file expects, by mean and by summed loss, and its per-ending losses equal the plain GPT's.
- Layouts: the same losses, picks and samples at (dp, tp, pp) = (1,1,1), (2,2,1), (1,2,2), (2,1,2) ZBV and DualPipeV,
  (1,4,1) and (2,1,2) under ZeRO-3, in one world of 4 processes; samples are a function of (seed, step) and equal the
  plain GPT's.
- Training and the evaluate command: a short run logs hellaswag_acc at its evaluations (metrics.jsonl and W&B) and
  prints samples (W&B gets a table); its checkpoint, evaluated at other layouts, gives the same losses and accuracy.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers.distributed import launch_env, run_world
from helpers.ds_ops import require_ops
from trainer3d.data.hellaswag import IGNORE, encode_rows, read_examples, score
from trainer3d.errors import DataError
from trainer3d.generate import pick_next_token
from trainer3d.models import init_value
from trainer3d.parallel.shards import from_full
from trainer3d.models.gpt2 import GPT
from trainer3d.train.downstream import sample_generator
from helpers.wandb_reader import read_history

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["<eos>"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + [f"w{i}" for i in range(37)]  # 64 ids
VOCAB, SEQ, GLOBAL_BATCH, EMBD = len(WORDS), 16, 8, 32
LONG = " ".join("abcdefghijklmnopqrstuvwxy") + " k l m"  # 28 tokens: left-truncated to fit 17
# The model repeats the previous token, so the right ending (mostly) repeats the context's last word.
EXAMPLES = [
    {"ctx": "a b c", "endings": ["c c", "d e", "f g", "h i"], "label": 0},
    {"ctx": "d e f", "endings": ["g h", "f f f", "a b", "c d"], "label": 1},
    # mean and sum disagree: eight cheap repeats then four expensive tokens, against one expensive token
    {"ctx": "x y z", "endings": ["z z z z z z z z q r s t", "k", "m n", "o p"], "label": 0},
    {"ctx": "a a", "endings": ["b c", "a a", "d e", "e f"], "label": 2},  # the model is wrong here
    {"ctx": LONG, "endings": ["m m", "n o", "p q", "r s"], "label": 0},
]
PICKS, PICKS_SUM, ACC, ACC_SUM = [0, 1, 0, 1, 0], [0, 1, 1, 1, 0], 4 / 5, 3 / 5


def encode(texts: list[str]) -> list[list[int]]:
    return [[WORDS.index(w) for w in t.split()] for t in texts]


def model_config():
    from trainer3d.config import TrainConfig

    return TrainConfig(model="tiny", n_layer=4, n_head=4, n_embd=EMBD, vocab_size=VOCAB).model_config(VOCAB)


def full_value(name: str, shape: tuple) -> torch.Tensor:
    """GPT-2's init (small random blocks), but a tied embedding of centered N(0, 1) rows and ln_f gain 0.5: the
    last position's logit of token s is ~0.5·e_t·e_s, 16 for s = t against N(0, 2.8) for the others."""
    if name in ("wte.weight", "lm_head.weight"):
        e = torch.randn(shape, generator=torch.Generator().manual_seed(7))
        return e - e.mean(dim=1, keepdim=True)
    if name == "ln_f.weight":
        return torch.full(shape, 0.5)
    return init_value(model_config(), name, shape, seed=3)


def plain_gpt() -> GPT:
    model = GPT(model_config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(full_value(name, tuple(p.shape)))
    return model


def write_jsonl(path: Path, objects: list) -> Path:
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objects))
    return path


# ---- the file ---------------------------------------------------------------------------------------------------
def test_every_malformed_line_is_named(tmp_path):
    good = {"ctx": "a b", "endings": ["c", "d", "e", "f"], "label": 1}
    cases = [
        ("{not json", "line 2 is not valid JSON (Expecting property name enclosed in double quotes"),
        ("[1, 2]", "line 2 is a JSON list, not an object"),
        (json.dumps({"ctx": "a", "endings": ["b", "c"]}), "line 2 has no 'label'"),
        (json.dumps({"ctx": "", "endings": ["b", "c"], "label": 0}), "line 2 has a 'ctx' that is not a non-empty text"),
        (json.dumps({"ctx": "a", "endings": "b c", "label": 0}), "line 2 has 'endings' that are not a list of at"),
        (json.dumps({"ctx": "a", "endings": ["b", 3], "label": 0}), "line 2 has 'endings' that are not a list"),
        (json.dumps({"ctx": "a", "endings": ["b", "c"], "label": 2}), "line 2 has a 'label' of 2, not an index into"),
        (json.dumps({"ctx": "a", "endings": ["b", "c"], "label": True}), "line 2 has a 'label' of True"),
        (json.dumps({"ctx": "a", "endings": ["b", "c"], "label": "1"}), "line 2 has a 'label' of '1'"),
    ]
    for bad, message in cases:
        path = write_jsonl(tmp_path / "bad.jsonl", [good, bad, good])
        with pytest.raises(DataError) as e:
            read_examples(path)
        text = str(e.value)
        assert f"HellaSwag file {path}, {message}" in text, text
        assert text.endswith('"label" (the right ending\'s index).') and "\n" not in text, text
    with pytest.raises(DataError, match="does not exist"):
        read_examples(tmp_path / "missing.jsonl")
    with pytest.raises(DataError, match="holds no examples"):
        read_examples(write_jsonl(tmp_path / "empty.jsonl", ["", "  "]))
    path = write_jsonl(tmp_path / "ok.jsonl", [good, "", good, good])  # blank lines are skipped
    assert len(read_examples(path)) == 3 and len(read_examples(path, limit=2)) == 2
    assert read_examples(path)[0].endings == ("c", "d", "e", "f") and read_examples(path)[0].label == 1
    with pytest.raises(DataError, match=r"--hellaswag-examples 4 exceeds the 3 examples"):
        read_examples(path, limit=4)


def test_rows_score_the_ending_only(tmp_path):
    examples = read_examples(write_jsonl(tmp_path / "h.jsonl", EXAMPLES))
    rows = encode_rows(examples, encode, SEQ, VOCAB)
    assert len(rows) == 20 and rows.first_row.tolist() == [0, 4, 8, 12, 16, 20]
    inputs, targets = rows.batch([0, 19, 20], pad_id=0)  # 20: past the end, a padding row
    a, b, c = (WORDS.index(w) for w in "abc")
    assert inputs[0, :4].tolist() == [a, b, c, c] and inputs[0, 4:].eq(0).all()
    assert targets[0, :2].eq(IGNORE).all() and targets[0, 2:4].tolist() == [c, c] and targets[0, 4:].eq(IGNORE).all()
    long = encode([LONG + " r s"])[0][-(SEQ + 1):]  # left-truncated: the ending kept whole
    assert inputs[1].tolist() == long[:-1] and targets[1, : SEQ - 2].eq(IGNORE).all()
    assert targets[1, SEQ - 2 :].tolist() == long[-2:]
    assert inputs[2].eq(0).all() and targets[2].eq(IGNORE).all()
    with pytest.raises(DataError, match="outside the model's vocabulary of 10"):
        encode_rows(examples, encode, SEQ, 10)
    result = score(rows, np.arange(20.0)[::-1], np.ones(20))  # the last ending always cheapest
    assert result.picks == [3] * 5 and result.acc == 0.0


def reference_losses() -> list[list[tuple[float, int]]]:
    """(summed loss, tokens) of every ending from the plain GPT, one row at a time, truncated independently."""
    model = plain_gpt()
    out = []
    for ex in EXAMPLES:
        ctx = encode([ex["ctx"]])[0]
        per = []
        for ending in encode(ex["endings"]):
            row = (ctx + ending)[-(SEQ + 1):]
            n_end = min(len(ending), len(row) - 1)
            with torch.no_grad():
                logits = model(torch.tensor([row[:-1]]))[0]
            losses = F.cross_entropy(logits, torch.tensor(row[1:]), reduction="none")[-n_end:]
            per.append((losses.sum().item(), n_end))
        out.append(per)
    return out


def reference_samples(prompt: list[int], n_tokens: int, count: int, temperature: float, top_k: int,
                      seed: int, step: int) -> list[list[int]]:
    model = plain_gpt()
    gen = sample_generator(seed, step)
    seqs = torch.tensor(prompt).repeat(count, 1)
    for _ in range(n_tokens):
        with torch.no_grad():
            logits = model(seqs[:, -SEQ:])[:, -1, :]
        seqs = torch.cat([seqs, pick_next_token(logits, temperature, top_k, gen)[:, None]], dim=1)
    return seqs[:, len(prompt):].tolist()


# ---- the layouts, in one world -----------------------------------------------------------------------------------
SAMPLE = dict(prompt=[0, 1, 2], n_tokens=20, count=3, temperature=4.0, top_k=10, seed=5)  # 23 tokens > SEQ: a window


def _layouts(rank: int, world_size: int, path: str, cases: list) -> list:
    from trainer3d.config import TrainConfig
    from trainer3d.train.downstream import hellaswag, sample
    from trainer3d.train.setup import validate
    from trainer3d.train.trainer import Trainer

    rows = encode_rows(read_examples(path), encode, SEQ, VOCAB)
    out = []
    for case in cases:
        case = dict(case)
        dp = case.pop("dp")
        cfg = TrainConfig(model="tiny", n_layer=4, n_head=4, n_embd=EMBD, vocab_size=VOCAB, seq_len=SEQ,
                          global_batch=GLOBAL_BATCH, precision="fp32", seed=SAMPLE["seed"], **case)
        n = dp * cfg.tp * cfg.pp
        setup = validate(cfg, n, VOCAB)
        topo = setup.topology(list(range(n)))
        result = None
        if topo.active:
            trainer = Trainer(setup, topo, torch.device("cpu"), cfg.model_config(VOCAB),
                              shard_value=from_full(full_value))
            res = hellaswag(trainer, rows, pad_id=0)
            s = SAMPLE
            draw = lambda step: sample(trainer, s["prompt"], s["count"], s["n_tokens"], s["temperature"],  # noqa: E731
                                       s["top_k"], sample_generator(s["seed"], step), pad_id=0)
            result = {"loss_sum": res.loss_sum, "loss_mean": res.loss_mean, "picks": res.picks,
                      "picks_sum": res.picks_sum, "acc": res.acc, "acc_sum": res.acc_sum,
                      "samples": draw(7), "again": draw(7), "other_step": draw(8)}
            for e in getattr(trainer.engine, "engines", []):
                e.destroy()
        topo.destroy()
        out.append(result)
    return out


def zero3() -> dict:
    return {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 3,
                                                                          "stage3_param_persistence_threshold": 0}}


def test_picks_losses_and_samples_at_every_layout(tmp_path):
    path = str(write_jsonl(tmp_path / "h.jsonl", EXAMPLES))
    cases = [
        dict(dp=1),
        dict(dp=2, tp=2),
        dict(dp=1, tp=2, pp=2),
        dict(dp=2, pp=2, schedule="zbv"),  # V-shaped: the last stage on pp rank 0, next to the first
        dict(dp=2, pp=2, schedule="dualpipev"),
        dict(dp=1, tp=4),  # tp ranks 1-3 hold only vocabulary padding (64 ids, padded to 512)
    ]
    names = ["1x1x1", "2x2x1 1f1b", "1x2x2 1f1b", "2x1x2 zbv", "2x1x2 dualpipev", "1x4x1"]
    require_ops()  # ZeRO-3's CPU ops (tests/helpers/ds_ops.py builds them once)
    cases.append(dict(dp=2, pp=2, deepspeed_config=zero3()))
    names.append("2x1x2 1f1b ZeRO-3")
    results = run_world(4, _layouts, path, cases, timeout=300)
    ref_losses = reference_losses()
    ref_samples = reference_samples(SAMPLE["prompt"], SAMPLE["n_tokens"], SAMPLE["count"], SAMPLE["temperature"],
                                    SAMPLE["top_k"], SAMPLE["seed"], 7)
    assert len(set(map(tuple, ref_samples))) > 1 and any(len(set(s)) > 3 for s in ref_samples)  # not a constant
    for i, name in enumerate(names):
        per_rank = [r[i] for r in results if r[i] is not None]
        assert per_rank, name
        for r in per_rank:  # every rank of a layout holds every result
            assert r == per_rank[0], f"{name}: ranks disagree"
        r = per_rank[0]
        assert r["picks"] == PICKS and r["picks_sum"] == PICKS_SUM, (name, r["picks"], r["picks_sum"])
        assert r["acc"] == ACC and r["acc_sum"] == ACC_SUM, name
        for got_sum, got_mean, ref in zip(r["loss_sum"], r["loss_mean"], ref_losses):
            for s, m, (ref_sum, n) in zip(got_sum, got_mean, ref):
                assert abs(s - ref_sum) < 1e-4 and abs(m - ref_sum / n) < 1e-5, (name, s, ref_sum, n)
        assert r["samples"] == ref_samples, (name, r["samples"], ref_samples)
        assert r["again"] == r["samples"] and r["other_step"] != r["samples"], name


# ---- training and the evaluate command ---------------------------------------------------------------------------
REAL_EXAMPLES = [
    {"ctx": "The cat sat on the", "endings": ["mat.", "quantum of", "ran away yesterday", "blue"], "label": 0},
    {"ctx": "She opened the door and", "endings": ["walked in.", "the the the", "seven", "purple"], "label": 0},
    {"ctx": "To be or not to be, that is the", "endings": ["question.", "banana", "car engine", "forty"], "label": 0},
    {"ctx": "He poured the milk into the", "endings": ["glass.", "sky above", "Tuesday", "of of"], "label": 3},
]


def _env(tmp: Path) -> dict:
    (tmp / "wandb").mkdir(exist_ok=True)
    return launch_env(WANDB_MODE="offline", WANDB_DIR=str(tmp / "wandb"))


def _run(cmd: list[str], env: dict) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return p


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hellaswag_run")
    data = write_jsonl(tmp / "hellaswag.jsonl", REAL_EXAMPLES)
    out = tmp / "run"
    cmd = [sys.executable, str(ROOT / "launch" / "train_gpt2.py"), "--model", "tiny", "--n-layer", "2",
           "--seq-len", "32", "--global-batch", "4", "--max-steps", "4", "--eval-every", "2", "--eval-batches", "1",
           "--log-every", "1", "--eval-hellaswag", str(data), "--sample-every", "2", "--sample-tokens", "6",
           "--sample-prompt", "The", "--save-every", "4", "--out-dir", str(out), "--wandb-project", "trainer3d-test"]
    p = _run(cmd, _env(tmp))
    return tmp, data, out, p.stdout + p.stderr


def test_training_logs_hellaswag_and_samples(trained):
    tmp, _, out, console = trained
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "hellaswag_acc" in r]
    assert [r["step"] for r in evals] == [0, 2, 4] == [r["step"] for r in records if "val_loss" in r]
    for r in evals:
        assert r["hellaswag_acc"] in (0, 0.25, 0.5, 0.75, 1) and r["hellaswag_acc_sum"] in (0, 0.25, 0.5, 0.75, 1)
    assert f"| hellaswag {evals[-1]['hellaswag_acc']:.4f}" in console
    printed = {}
    for line in console.splitlines():
        if "| sample " in line:
            head, text = line.split(": ", 1)
            printed[(int(head.split("step")[-1].split("|")[0]), int(head.split("sample ")[-1]))] = json.loads(text)
    assert sorted(printed) == [(2, 0), (2, 1), (4, 0), (4, 1)], console[-3000:]
    assert all(t.startswith("The") and len(t) > 3 for t in printed.values())
    run_dir = glob.glob(str(tmp / "wandb" / "wandb" / "offline-run-*"))[0]
    history = read_history(glob.glob(os.path.join(run_dir, "run-*.wandb"))[0])
    logged = {row["_step"]: row for row in history}
    assert [s for s in sorted(logged) if "hellaswag_acc" in logged[s]] == [0, 2, 4]
    assert logged[4]["hellaswag_acc_sum"] == evals[-1]["hellaswag_acc_sum"]
    assert logged[4]["samples/_type"] == "table-file" and logged[2]["samples/nrows"] == 2  # a table, growing
    table = json.loads(Path(run_dir, "files", logged[4]["samples/path"]).read_text())
    assert table["columns"] == ["step", "sample", "text"]
    assert {(s, i): t for s, i, t in table["data"]} == printed


def _evaluate_at_layouts(rank: int, world_size: int, argvs: list) -> list:
    from trainer3d.evaluate import main

    return [main(argv) for argv in argvs]


def test_evaluate_a_checkpoint_at_other_layouts(trained, tmp_path):
    _, data, out, _ = trained
    env = _env(tmp_path)
    base = [str(out), "--hellaswag", str(data)]
    same = tmp_path / "same.json"
    p = _run([sys.executable, "-m", "trainer3d.evaluate", *base, "--output", str(same)], env)
    assert "hellaswag_acc" in p.stdout and "at dp1×tp1×pp1" in p.stdout
    reference = json.loads(same.read_text())
    final = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert reference["step"] == 4 and reference["examples"] == len(REAL_EXAMPLES)
    for key in ("hellaswag_acc", "hellaswag_acc_sum"):
        assert reference[key] == final[key], key
    layouts = {"tp2": ["--tp", "2"], "pp2": ["--pp", "2", "--global-batch", "2"], "dp2": ["--hellaswag-examples", "3"]}
    argvs = [base + flags + ["--output", str(tmp_path / f"{name}.json")] for name, flags in layouts.items()]
    assert run_world(2, _evaluate_at_layouts, argvs, timeout=300) == [[0, 0, 0], [0, 0, 0]]
    for name in layouts:
        got = json.loads((tmp_path / f"{name}.json").read_text())
        n = got["examples"]
        assert got["layout"]["dp"] * got["layout"]["tp"] * got["layout"]["pp"] == 2, name
        assert [e["pick"] for e in got["per_example"]] == [e["pick"] for e in reference["per_example"][:n]], name
        for e, ref in zip(got["per_example"], reference["per_example"]):
            assert np.allclose(e["loss_mean"], ref["loss_mean"], rtol=0, atol=1e-5), (name, e, ref)
        if n == len(REAL_EXAMPLES):
            assert got["hellaswag_acc"] == reference["hellaswag_acc"], name
