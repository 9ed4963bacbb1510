"""Weighted data mixtures (trainer3d/data/mixture.py, --data-mixture): the share of rows each source gets, the draw
rule, epochs, exact resume at another dp, the file's bad input, and one end-to-end run (data_mix in metrics.jsonl,
per-source validation, stopped at step 10 and resumed at dp 2 with the uninterrupted losses; one source a prepared
directory).

The loader tests run in this process over synthetic blocks whose first token names the source and row."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.distributed import run_world
from helpers.parity import LOSS_RTOL
from helpers.wandb_reader import read_history
from trainer3d.data.batch import LabeledRows, supervised_count
from trainer3d.data.cache import TokenBlocks
from trainer3d.data.mixture import MixtureBlocks, MixtureLoader, draw, mixture_validation, read_mixture
from trainer3d.errors import DataError

SEQ = 7
TAG = 1000  # a row's first token: source * TAG + row


def _blocks(source: int, n_train: int, n_val: int = 8) -> TokenBlocks:
    rows = np.zeros((n_train + n_val, SEQ + 1), dtype=np.int32)
    rows[:, 0] = source * TAG + np.arange(n_train + n_val)
    rows[:, 1:] = source + 1
    return TokenBlocks(rows[:n_train], rows[n_train:], SEQ, 1 << 16, 0, f"synthetic{source}-{n_train}", {})


def _mixture(weights=(3.0, 1.0), sizes=(50, 23)) -> MixtureBlocks:
    total = sum(weights)
    return MixtureBlocks([f"s{i}" for i in range(len(sizes))], [w / total for w in weights],
                         [_blocks(i, n) for i, n in enumerate(sizes)], eos_id=0)


def _global_batches(loaders: list[MixtureLoader], steps: int) -> list[np.ndarray]:
    """The first tokens of each step's global batch: every dp rank's rows, in rank order."""
    return [torch.cat([ld.next_batch().tokens for ld in loaders])[:, 0].numpy() for _ in range(steps)]


def _loaders(blocks, gb: int, dp: int, seed: int = 5) -> list[MixtureLoader]:
    return [MixtureLoader(blocks, gb, r, dp, seed) for r in range(dp)]


def test_three_to_one_gives_75_percent_of_rows_over_20_steps():
    loaders = _loaders(_mixture(), gb=8, dp=2)
    rows = np.concatenate(_global_batches(loaders, 20))
    first = float(np.mean(rows // TAG == 0))
    assert 0.73 <= first <= 0.77, first
    assert loaders[0].drawn() == loaders[1].drawn() == {"s0": int((rows // TAG == 0).sum()), "s1": int((rows // TAG == 1).sum())}
    assert sum(loaders[0].drawn().values()) == 160


def test_draw_is_greedy_and_independent_of_the_batch_size():
    shares = np.array([0.5, 0.3, 0.2])
    whole = draw(shares, np.zeros(3, np.int64), 0, 240)
    counts = np.stack([np.cumsum(whole == s) for s in range(3)], axis=1)
    n = np.arange(1, 241)[:, None]
    assert np.abs(counts - shares * n).max() < 1  # every prefix within one row of its share
    pieces, drawn = [], np.zeros(3, np.int64)
    for start in range(0, 240, 24):  # batch by batch, from the counts so far
        part = draw(shares, drawn, start, 24)
        drawn += np.bincount(part, minlength=3)
        pieces.append(part)
    assert np.array_equal(np.concatenate(pieces), whole)


def test_a_source_that_runs_out_starts_a_reshuffled_epoch():
    loader = MixtureLoader(_mixture((1.0, 1.0), (40, 5)), 2, 0, 1, seed=3)
    rows = np.concatenate([loader.next_batch().tokens[:, 0].numpy() for _ in range(20)])
    small = rows[rows // TAG == 1] % TAG
    assert len(small) == 20
    epochs = small.reshape(4, 5)
    assert all(sorted(e) == [0, 1, 2, 3, 4] for e in epochs)  # each epoch: every row once
    assert len({tuple(e) for e in epochs}) > 1  # reshuffled
    big = rows[rows // TAG == 0] % TAG
    assert len(set(big)) == 20  # the big source is still in its first epoch: no row twice


@pytest.mark.parametrize("dp_before,dp_after", [(2, 1), (1, 2), (4, 2)])
def test_resume_is_exact_at_another_dp(dp_before, dp_after):
    blocks, gb = _mixture((2.0, 1.0), (13, 7)), 8  # both sources wrap several epochs
    straight = _global_batches(_loaders(blocks, gb, dp_before), 12)
    first = _loaders(blocks, gb, dp_before)
    head = _global_batches(first, 5)
    state = json.loads(json.dumps(first[0].state_dict()))
    assert all(ld.state_dict() == state for ld in first)
    after = _loaders(blocks, gb, dp_after, seed=0)  # the checkpoint's seed wins
    for ld in after:
        ld.load_state_dict(state)
    tail = _global_batches(after, 7)
    assert all(np.array_equal(a, b) for a, b in zip(head + tail, straight))


def test_resume_refuses_another_mixture():
    state = MixtureLoader(_mixture((3.0, 1.0)), 8, 0, 1).state_dict()
    with pytest.raises(DataError, match="resume with the same --data-mixture file"):
        MixtureLoader(_mixture((2.0, 1.0)), 8, 0, 1).load_state_dict(state)


def test_supervised_count_of_the_whole_global_batch_over_sources():
    """A chat source's rows (LabeledRows) beside plain rows: the batch's targets count both over every dp rank."""
    chat = _blocks(1, 30).train
    flags = np.zeros_like(chat)
    flags[:, 4:] = 1  # 4 supervised targets a row
    labeled = LabeledRows(chat, flags, np.zeros_like(chat))
    blocks = MixtureBlocks(["text", "chat"], [0.5, 0.5], [_blocks(0, 30).train, labeled], eos_id=0)
    batches = [MixtureLoader(blocks, 8, r, 2).next_batch() for r in range(2)]
    assert batches[0].targets == batches[1].targets == 4 * SEQ + 4 * 4
    for b in batches:
        is_chat = b.tokens[:, 0] // TAG == 1
        assert b.supervised[~is_chat].all() and b.supervised[is_chat].sum() == 4 * int(is_chat.sum())
        assert b.documents is not None and b.documents.shape == b.tokens.shape
    assert supervised_count(labeled, np.arange(2)) == 8
    # the validation loss is the training objective's: a source weighs its share times its targets a row
    val = MixtureBlocks(["text", "chat"], [0.5, 0.5], [_blocks(0, 30), TokenBlocks(labeled, labeled, SEQ, 99, 0, "c")],
                        eos_id=0)
    record = mixture_validation(val, 8, 0, 1).record(lambda batches: 2.0 if batches is not None and next(
        iter(batches)).supervised is None else 4.0)
    assert record["val_loss"] == pytest.approx((0.5 * SEQ * 2.0 + 0.5 * 4 * 4.0) / (0.5 * SEQ + 0.5 * 4))


def test_a_source_gives_its_own_data_options(tmp_path):
    """split, messages_field, train_on and train_roles of an entry replace the run's for that source only."""
    from trainer3d.data.sources import DataConfig

    corpus = _write(tmp_path, "c.jsonl", "")
    path = _write(tmp_path, "m.json", [{"source": corpus, "weight": 1, "format": "chat", "split": "train[:50%]",
                                        "messages_field": "turns", "train_on": "last", "train_roles": "assistant"},
                                       {"source": corpus, "weight": 1}])
    run = DataConfig(train_on="all", messages_field="messages")
    chat, text = (s.data_config_of(run) for s in read_mixture(path))
    assert (chat.format, chat.split, chat.messages_field, chat.train_on, chat.train_roles) == (
        "chat", "train[:50%]", "turns", "last", "assistant")
    assert (text.format, text.split, text.messages_field, text.train_on) == ("text", "train", "messages", "all")


# ---- bad input: one sentence and exit 2 through the CLI ---------------------------------------------------------
def _write(tmp: Path, name: str, content) -> str:
    path = tmp / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def _bad_cases(tmp: Path):
    corpus = _write(tmp, "c.txt", "some text")
    return [
        ([], str(tmp / "none.json"), lambda p: f"--data-mixture {p} does not exist; pass a JSON file listing "
                                               '{"source": ..., "weight": ...} objects.'),
        ([], _write(tmp, "bad.json", "[{"), lambda p: f"--data-mixture {p} is not valid JSON ("),
        ([], _write(tmp, "empty.json", []), lambda p: f"--data-mixture {p} must hold a non-empty JSON list of "
                                                      '{"source": ..., "weight": ...} objects.'),
        ([], _write(tmp, "key.json", [{"source": corpus, "weight": 1, "wieght": 2}]),
         lambda p: f"--data-mixture {p}, entry 1 has an unknown key 'wieght'; the keys are source, weight, format, "
                   "text_field, data_config, split, messages_field, train_on, train_roles."),
        ([], _write(tmp, "noweight.json", [{"source": corpus, "weight": 1}, {"source": corpus}]),
         lambda p: f"--data-mixture {p}, entry 2 has no 'weight'; every entry needs \"source\" and \"weight\"."),
        ([], _write(tmp, "neg.json", [{"source": corpus, "weight": -1}]),
         lambda p: f"--data-mixture {p}, entry 1 has a weight of -1; a weight must be a positive finite number."),
        ([], _write(tmp, "nan.json", '[{"source": "c.txt", "weight": NaN}]'),
         lambda p: f"--data-mixture {p}, entry 1 has a weight of nan; a weight must be a positive finite number."),
        ([], _write(tmp, "fmt.json", [{"source": corpus, "weight": 1, "format": "json"}]),
         lambda p: f"--data-mixture {p}, entry 1 has a format of 'json'; use one of text, chat, sharegpt."),
        ([], _write(tmp, "missing.json", [{"source": "./nope.txt", "weight": 1}]),
         lambda p: f"--data-mixture {p}, entry 1: Data path './nope.txt' does not exist; pass an existing "
                   ".txt/.jsonl/.json/.parquet file, a folder of them, a save_to_disk folder, or a Hugging Face "
                   "dataset name."),
        (["--data", corpus], _write(tmp, "ok.json", [{"source": corpus, "weight": 1}]),
         lambda p: "--data and --data-mixture both name the training data; pass only one of them (a mixture's file "
                   "lists its sources)."),
        (["--data-config", "all"], _write(tmp, "ok2.json", [{"source": corpus, "weight": 1}]),
         lambda p: "--data-config names one dataset's config; with --data-mixture give the source its own "
                   "\"data_config\" in the file."),
    ]


def test_bad_mixture_files_get_one_sentence_and_exit_2(tmp_path, monkeypatch, capsys):
    from trainer3d.train.loop import main

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    out = tmp_path / "out"
    for extra, path, sentence in _bad_cases(tmp_path):
        rc = main(["--model", "tiny", "--max-steps", "1", "--out-dir", str(out), "--data-mixture", path, *extra])
        err = capsys.readouterr().err
        assert rc == 2, (path, err)
        assert f"trainer3d: error: {sentence(path)}" in err, (path, err)
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


# ---- end to end: two corpora, 3:1, 20 steps; stopped at 10 and resumed at dp 2 -----------------------------------
TINY = ["--model", "tiny", "--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--seq-len", "32",
        "--global-batch", "4", "--eval-batches", "1", "--log-every", "1000", "--lr", "1e-3", "--warmup-steps", "2",
        "--eval-every", "10", "--precision", "fp32"]


@pytest.fixture(scope="module")
def mixture_file(tmp_path_factory):
    """Two small corpora of different words: plays.txt, tokenized by the run, and garden/, a prepared directory."""
    from trainer3d.data.prepare import main as prepare

    d = tmp_path_factory.mktemp("mixture")
    rng = random.Random(0)
    for name, words in (("plays", "king queen castle crown sword ghost night"),
                        ("garden", "rose tree river green summer bird rain")):
        words = words.split()
        (d / f"{name}.txt").write_text(
            "\n\n".join(" ".join(rng.choice(words) for _ in range(120)) + "." for _ in range(30)))
    assert prepare([str(d / "garden.txt"), str(d / "garden"), "--num-proc", "1", "--val-tokens", "600"]) == 0
    path = d / "mix.json"
    path.write_text(json.dumps([{"source": str(d / "plays.txt"), "weight": 3},
                                {"source": str(d / "garden"), "weight": 1}]))
    return path, d / "cache"


def _main(rank, world_size, args):
    from trainer3d.train.loop import main

    return main(args)


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _losses(records) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def test_mixture_run_logs_data_mix_and_resumes_at_dp2(mixture_file, tmp_path, monkeypatch):
    path, cache = mixture_file
    for k in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("TRAINER3D_CACHE", str(cache))
    monkeypatch.setenv("TQDM_DISABLE", "1")
    args = TINY + ["--data-mixture", str(path)]
    straight, resumed_dir = tmp_path / "straight", tmp_path / "resumed"
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    (tmp_path / "wandb").mkdir()
    assert _main(0, 1, args + ["--max-steps", "20", "--save-every", "10", "--out-dir", str(straight),
                               "--wandb-mode", "offline"]) == 0
    records = _records(straight)
    last = records[-1]
    assert last["step"] == 20 and sum(last["data_mix"].values()) == 80
    assert abs(last["data_mix"]["plays"] / 80 - 0.75) <= 0.02
    assert [r["data_mix"]["garden"] for r in records if "loss" in r][:4] == [1, 2, 3, 4]  # one row a global batch
    (wandb_file,) = (tmp_path / "wandb").glob("wandb/offline-run-*/run-*.wandb")
    history = {row["_step"]: row for row in read_history(str(wandb_file))}
    for r in records:
        for name, count in r.get("data_mix", {}).items():
            assert history[r["step"]][f"data_mix/{name}"] == count
    assert history[20]["data_mix/plays"] == last["data_mix"]["plays"] and "val_loss/garden" in history[20]
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evals] == [0, 10, 20]
    for r in evals:
        assert r["val_loss/plays"] != r["val_loss/garden"]
        assert r["val_loss"] == pytest.approx(0.75 * r["val_loss/plays"] + 0.25 * r["val_loss/garden"], rel=1e-9)
    assert evals[-1]["val_loss/plays"] < evals[0]["val_loss/plays"]
    assert evals[-1]["val_loss/garden"] < evals[0]["val_loss/garden"]

    # the run as stopped after its step-10 checkpoint, resumed from it at dp 2 (a world of two processes)
    step10 = straight / "checkpoints" / "step_000010"
    assert json.loads((step10 / "meta.json").read_text())["loader"]["drawn"] == {"plays": 30, "garden": 10}
    assert run_world(2, _main, args + ["--max-steps", "20", "--out-dir", str(resumed_dir), "--resume", str(step10)],
                     timeout=120) == [0, 0]
    resumed = _records(resumed_dir)
    assert resumed[-1]["data_mix"] == last["data_mix"]
    want, got = _losses(records), _losses(resumed)
    assert sorted(got) == list(range(11, 21))
    for step in range(11, 21):
        assert got[step] == pytest.approx(want[step], rel=LOSS_RTOL), step
