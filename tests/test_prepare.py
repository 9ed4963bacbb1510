"""Prepared token shards (trainer3d/data/prepare.py, shards.py): the tokens are the GPT-2 BPE's, a killed prepare
resumes to the same bytes, windows read across shard boundaries at any seq_len, bad directories are refused with
one sentence, and a run trained from shards at (dp, tp, pp) = (2, 1, 2) resumes at (1, 2, 2) on its losses."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest

from helpers.distributed import free_port, launch_env
from helpers import fault_plugin
from trainer3d.data.prepare import build_parser, prepare
from trainer3d.data.shards import TokenWindows, open_windows, read_manifest
from trainer3d.errors import DataError

REPO = Path(__file__).resolve().parent.parent
WORDS = ("the king and queen of a small castle were walking in gardens under bright summer skies while hungry "
         "crows watched from old towers near rivers that ran to distant seas beyond green hills").split()


def _docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40))) for _ in range(rng.randint(1, 8)))
            + rng.choice(["", ".", " 42!", "\n\n  ✓ naïve"]) for _ in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("prep_corpus")
    docs = _docs(600)
    docs[5] = ""  # an empty document: no tokens, no EOS
    with open(d / "docs.jsonl", "w") as f:
        for t in docs:
            f.write(json.dumps({"text": t, "id": len(t)}) + "\n")
    return d / "docs.jsonl", docs


def _args(source, out, **kw) -> Namespace:
    argv = [str(source), str(out), "--num-proc", "2", "--shard-tokens", "4000", "--val-tokens", "3000"]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return build_parser().parse_args(argv)


def _stream(out: Path, manifest: dict) -> np.ndarray:
    return np.concatenate([np.fromfile(out / s["file"], dtype=manifest["dtype"])
                           for split in ("val", "train") for s in manifest["shards"][split]])


def _expected(docs: list[str]) -> np.ndarray:
    """EOS + the Hugging Face GPT-2 tokenizer's ids of every non-empty document (the reference, not tiktoken)."""
    from trainer3d.data import load_tokenizer

    tok = load_tokenizer(None)
    out = []
    for t in docs:
        ids = tok(t, add_special_tokens=False)["input_ids"]
        if ids:
            out += [tok.eos_token_id] + ids
    return np.array(out, dtype=np.uint16)


def test_prepare_writes_the_gpt2_tokens_in_shards(corpus, tmp_path):
    source, docs = corpus
    m = prepare(_args(source, tmp_path / "p"), say=lambda s: None)
    assert m["complete"] and m["tokenizer"]["vocab_size"] == 50257 and m["stats"]["encoder"] == "tiktoken"
    assert [s["tokens"] for s in m["shards"]["val"]] == [3000]
    train = [s["tokens"] for s in m["shards"]["train"]]
    assert len(train) >= 3 and all(n == 4000 for n in train[:-1]) and 0 < train[-1] <= 4000
    expected = _expected(docs)
    assert np.array_equal(_stream(tmp_path / "p", m), expected)
    assert read_manifest(tmp_path / "p") == m
    # the same tokens through the `tokenizers` backend (the bundled files named as a folder: not the tiktoken path)
    from trainer3d.data import BUNDLED_TOKENIZER_DIR

    m2 = prepare(_args(source, tmp_path / "q", tokenizer=BUNDLED_TOKENIZER_DIR, num_proc=1), say=lambda s: None)
    assert m2["stats"]["encoder"] == "tokenizers"
    assert np.array_equal(_stream(tmp_path / "q", m2), expected)
    # a prefix of the corpus with --max-tokens
    m3 = prepare(_args(source, tmp_path / "r", max_tokens=9000), say=lambda s: None)
    assert np.array_equal(_stream(tmp_path / "r", m3), expected[:9000])


def test_windows_cross_shards_at_any_seq_len(corpus, tmp_path):
    source, _ = corpus
    m = prepare(_args(source, tmp_path / "p"), say=lambda s: None)
    stream = np.concatenate([np.fromfile(tmp_path / "p" / s["file"], dtype=np.uint16) for s in m["shards"]["train"]])
    for seq_len in (7, 64, 1000, 3999):
        w = open_windows(tmp_path / "p", m, "train", seq_len)
        assert len(w) == (len(stream) - 1) // seq_len and w.shape == (len(w), seq_len + 1)
        idx = np.array([0, len(w) - 1, len(w) // 2, 4000 // seq_len])  # the last picks a window across a boundary
        got = w[idx]
        for row, i in zip(got, idx):
            assert np.array_equal(row, stream[i * seq_len : i * seq_len + seq_len + 1])
        assert np.array_equal(w[1:3], np.stack([stream[k * seq_len : k * seq_len + seq_len + 1] for k in (1, 2)]))
    with pytest.raises(IndexError):
        TokenWindows([tmp_path / "p" / "val_000000.bin"], [3000], np.dtype("<u2"), 100)[np.array([30])]


def _run_prepare(source, out, extra_env=None, wait=True):
    cmd = [sys.executable, "-m", "trainer3d.prepare", str(source), str(out), "--num-proc", "2",
           "--shard-tokens", "4000", "--val-tokens", "3000"]
    env = {**os.environ, "PYTHONPATH": str(REPO), **(extra_env or {})}
    if not wait:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def test_killed_prepare_resumes_to_the_same_bytes(corpus, tmp_path):
    source, _ = corpus
    straight = _run_prepare(source, tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr
    proc = _run_prepare(source, tmp_path / "killed", fault_plugin.env(TRAINER3D_TEST_PAUSE_PREPARE_AFTER_SHARDS="3"),
                        wait=False)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "killed" / "PAUSED").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
            time.sleep(0.1)
        (tmp_path / "killed" / "train_000002.bin.tmp-1-dead").write_bytes(b"\0" * 10)  # a shard cut short
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    (tmp_path / "killed" / "PAUSED").unlink()
    partial = json.loads((tmp_path / "killed" / "manifest.json").read_text())
    assert not partial["complete"] and len(partial["shards"]["train"]) == 2 and partial["resume"]["offset"] >= 0
    with pytest.raises(DataError, match="did not finish"):
        read_manifest(tmp_path / "killed")
    resumed = _run_prepare(source, tmp_path / "killed")
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming" in resumed.stdout
    a, b = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("straight", "killed"))
    assert a["shards"] == b["shards"]
    assert sorted(os.listdir(tmp_path / "straight")) == sorted(os.listdir(tmp_path / "killed"))
    for s in a["shards"]["val"] + a["shards"]["train"]:
        assert (tmp_path / "straight" / s["file"]).read_bytes() == (tmp_path / "killed" / s["file"]).read_bytes()
    again = _run_prepare(source, tmp_path / "killed")  # complete: nothing to do, nothing rewritten
    assert again.returncode == 0 and "already complete" in again.stdout


def test_bad_prepared_directories_are_refused(corpus, tmp_path):
    source, _ = corpus
    good = tmp_path / "good"
    prepare(_args(source, good), say=lambda s: None)

    def broken(name, damage):
        d = tmp_path / name
        subprocess.run(["cp", "-r", str(good), str(d)], check=True)
        damage(d)
        return d

    cases = {
        "no manifest.json": broken("nomanifest", lambda d: (d / "manifest.json").unlink()),
        "not readable JSON": broken("truncated", lambda d: (d / "manifest.json").write_text(
            (good / "manifest.json").read_text()[:100])),
        "holds 3,999 tokens": broken("short", lambda d: (d / "train_000001.bin").write_bytes(
            (good / "train_000001.bin").read_bytes()[:-2])),
    }
    for expected, d in cases.items():
        with pytest.raises(DataError, match=expected):
            read_manifest(d)
    # the same through the trainer's command line: one sentence, exit 2, before any process group
    env = {**os.environ, "PYTHONPATH": str(REPO), "TQDM_DISABLE": "1"}
    for d in cases.values():
        r = subprocess.run([sys.executable, str(REPO / "launch" / "train_gpt2.py"), "--data", str(d)],
                           env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and r.stderr.startswith("trainer3d: error:") and len(r.stderr.splitlines()) == 1, r.stderr
    # shards of another tokenizer
    other = broken("othertok", lambda d: None)
    m = json.loads((other / "manifest.json").read_text())
    m["tokenizer"]["identity"], m["tokenizer"]["name"] = "0" * 64, "EleutherAI/gpt-neox-20b"
    (other / "manifest.json").write_text(json.dumps(m))
    from trainer3d.data import DataConfig, build_token_blocks

    with pytest.raises(DataError, match="prepared with the tokenizer 'EleutherAI/gpt-neox-20b'"):
        build_token_blocks(DataConfig(data=str(other)), 32)


def test_prepare_bad_input_leaves_nothing(corpus, tmp_path, capsys, monkeypatch):
    from trainer3d.data.prepare import main

    source, _ = corpus
    cases = [
        ([str(source), str(tmp_path / "a"), "--val-tokens", "100000000"], "not more than --val-tokens"),
        ([str(source), str(tmp_path / "b"), "--text-field", "body"], "no column 'body'"),
        ([str(tmp_path / "missing.jsonl"), str(tmp_path / "c")], "does not exist"),
        ([str(source), str(tmp_path / "d"), "--num-proc", "0"], "--num-proc must be at least 1"),
        ([str(source), str(tmp_path / "e"), "--max-tokens", "10", "--val-tokens", "10"], "leaves no training tokens"),
    ]
    for argv, expected in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert expected in err and len(err.strip().splitlines()) == 1, err
        assert not Path(argv[1]).exists(), f"{argv[1]} left behind"
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    (tmp_path / "busy" / "draft.tmp-1").write_text("mine too")  # a temporary name, but not one prepare writes
    assert main([str(source), str(tmp_path / "busy")]) == 2
    assert "not a prepared directory" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path / "busy")) == ["draft.tmp-1", "notes.txt"]
    # killed before its first shard was complete: only a torn temporary shard, no manifest yet -> starts afresh
    (tmp_path / "early").mkdir()
    (tmp_path / "early" / "val_000000.bin.tmp-7-dead").write_bytes(b"\0" * 6)
    assert main([str(source), str(tmp_path / "early"), "--val-tokens", "3000"]) == 0
    assert read_manifest(tmp_path / "early")["complete"] and not list((tmp_path / "early").glob("*.tmp-*"))
    capsys.readouterr()
    # a source that cannot be streamed is loaded whole, with the reason printed
    import trainer3d.data.sources as sources

    real = sources._resolve_source

    def unstreamable(cfg, hf_cache):
        src = real(cfg, hf_cache)
        src.stream = lambda: (_ for _ in ()).throw(NotImplementedError("no streaming for this builder"))
        return src

    monkeypatch.setattr(sources, "_resolve_source", unstreamable)
    assert main([str(source), str(tmp_path / "f"), "--val-tokens", "3000"]) == 0
    out = capsys.readouterr().out
    assert "cannot be streamed (NotImplementedError: no streaming for this builder); loading it whole" in out
    assert read_manifest(tmp_path / "f")["complete"]


def _torchrun(args, out, cache, nproc=4):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           str(REPO / "launch" / "train_gpt2.py"), *args, "--out-dir", str(out)]
    env = launch_env(TRAINER3D_CACHE=str(cache), TQDM_DISABLE="1")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_train_from_shards_resumes_at_another_layout(corpus, tmp_path):
    """prepare -> 20 steps at (dp, tp, pp) = (2, 1, 2), checkpoint at 10 -> resumed at (1, 2, 2): the same losses."""
    source, _ = corpus
    shards = tmp_path / "shards"
    assert _run_prepare(source, shards).returncode == 0
    common = ["--data", str(shards), "--model", "tiny", "--n-layer", "4", "--n-embd", "64", "--n-head", "4",
              "--seq-len", "32", "--global-batch", "8", "--micro-batches", "2", "--max-steps", "20",
              "--eval-every", "10", "--eval-batches", "2", "--log-every", "100", "--precision", "fp32",
              "--lr", "1e-3", "--warmup-steps", "2"]
    straight = _torchrun(common + ["--pp", "2", "--save-every", "10"], tmp_path / "a", tmp_path / "cache")
    ckpt = tmp_path / "a" / "checkpoints" / "step_000010"
    assert ckpt.is_dir(), sorted(os.listdir(tmp_path / "a" / "checkpoints"))
    resumed = _torchrun(common + ["--tp", "2", "--pp", "2", "--resume", str(ckpt)], tmp_path / "b", tmp_path / "cache")
    a = {r["step"]: r for r in straight}
    b = {r["step"]: r for r in resumed}
    assert sorted(b) == list(range(11, 21))
    for step in range(11, 21):
        assert abs(a[step]["loss"] - b[step]["loss"]) <= 1e-5 * abs(a[step]["loss"]), (step, a[step], b[step])
    assert abs(a[20]["val_loss"] - b[20]["val_loss"]) <= 1e-5 * a[20]["val_loss"]
    assert a[20]["loss"] < a[1]["loss"] - 0.5  # it learned something from the shards


def big_vocab_tokenizer(directory: Path) -> Path:
    """A word-level tokenizer of some 70,000 tokens whose corpus words have ids above 65,535 (as Llama 3's 128,256 do)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<unused{i}>": i for i in range(70_000)}
    vocab.update({w: 70_000 + i for i, w in enumerate(sorted(set(WORDS)))})
    vocab["<unk>"], vocab["<|end_of_text|>"] = len(vocab), len(vocab) + 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|end_of_text|>").save_pretrained(
        str(directory))
    return directory


def test_large_vocabulary_is_uint32_in_the_cache_and_in_shards(corpus, tmp_path):
    """One rule (shards.token_dtype) for both stores: ids above 65,535 survive the data cache and prepared shards."""
    from trainer3d.data import DataConfig, build_token_blocks

    source, _ = corpus
    tok = big_vocab_tokenizer(tmp_path / "tok")
    cached = build_token_blocks(DataConfig(data=str(source), tokenizer=str(tok), cache_dir=str(tmp_path / "c")), 64)
    prepare(_args(source, tmp_path / "p", tokenizer=tok))
    shards = build_token_blocks(DataConfig(data=str(tmp_path / "p"), tokenizer=str(tok)), 64)
    assert cached.stats["dtype"] == "uint32" and read_manifest(tmp_path / "p")["dtype"] == "<u4"
    for blocks in (cached, shards):
        ids = np.asarray(blocks.train[:8])
        assert ids.max() > 65_535 and ids.min() >= 70_000  # every word and EOS sits above uint16's range
    assert cached.vocab_size == shards.vocab_size == 70_002 + len(set(WORDS))
