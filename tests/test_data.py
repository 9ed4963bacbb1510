"""Tests for trainer3d.data: tokenizer, corpus formats, cache, dp sharding, resume, validation, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer3d import data as D
from trainer3d.data import BatchLoader, DataConfig, DataError, TokenBlocks, build_token_blocks, val_batches
from trainer3d.data import cache as cache_module
from trainer3d.data.cache import _Encode, _n_val
from trainer3d.data.tokenizer import tokenizer_facts

REPO = Path(__file__).resolve().parents[1]

PARAGRAPHS = [
    "Now, fair Hippolyta, our nuptial hour draws on apace; four happy days bring in another moon.",
    "Four days will quickly steep themselves in night; four nights will quickly dream away the time.",
    "Go, Philostrate, stir up the Athenian youth to merriments; awake the pert and nimble spirit of mirth.",
    "Happy be Theseus, our renowned duke! Thanks, good Egeus: what's the news with thee?",
]


def docs(n: int) -> list[str]:
    return [f"Document {i}. " + " ".join(PARAGRAPHS[(i + j) % len(PARAGRAPHS)] for j in range(3)) for i in range(n)]


def synthetic_blocks(n_train: int = 103, n_val: int = 20, seq_len: int = 7) -> TokenBlocks:
    """Row i holds ids i*(seq_len+1) ..., so a row is identified by its first id."""
    rows = np.arange((n_train + n_val) * (seq_len + 1), dtype=np.int32).reshape(-1, seq_len + 1)
    return TokenBlocks(rows[:n_train], rows[n_train:], seq_len, 1 << 20, 0, "synthetic", {})


def row_ids(batch: torch.Tensor, seq_len: int = 7) -> list[int]:
    return (batch[:, 0] // (seq_len + 1)).tolist()


def build(tmp_path: Path, data: Path | str | None, seq_len: int = 16, **kw) -> TokenBlocks:
    cfg = DataConfig(data=None if data is None else str(data), cache_dir=str(tmp_path / "cache"), **kw)
    return build_token_blocks(cfg, seq_len)


def stream(blocks: TokenBlocks) -> np.ndarray:
    return np.concatenate([blocks.train.reshape(-1), blocks.val.reshape(-1)]).astype(np.int64)


# ------------------------------------------------------------------------------------------ tokenizer


def test_gpt2_tokenizer_known_ids():
    tok = D.load_tokenizer(None)
    assert tok("Hello world")["input_ids"] == [15496, 995]
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 50256 and len(tok) == 50257
    assert tok(" the The\n\n")["input_ids"] == [262, 383, 628]
    assert tok("<|endoftext|>")["input_ids"] == [50256]
    text = "Héllo wörld — naïve café 東京 🤖\ttabs   and  spaces"
    assert tok.decode(tok(text)["input_ids"]) == text
    alias = D.load_tokenizer("gpt2")  # served from the bundled files, no network
    assert alias("Hello world")["input_ids"] == [15496, 995]


# ------------------------------------------------------------------------------------- default corpus


def test_default_corpus_offline(tmp_path, monkeypatch):
    """Full bundled corpus with networking disabled (env + sockets refused), then a cached reload."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRAINER3D_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PYTHONPATH", str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    script = textwrap.dedent(
        """
        import json, socket, time
        def refuse(self, *a, **k):
            if self.family in (socket.AF_INET, socket.AF_INET6):
                raise OSError("network disabled in this test")
            return real_connect(self, *a, **k)
        real_connect = socket.socket.connect
        socket.socket.connect = refuse
        from trainer3d.data import DataConfig, build_token_blocks
        first = build_token_blocks(DataConfig(), 128)
        t = time.perf_counter()
        again = build_token_blocks(DataConfig(), 128)
        reload_s = time.perf_counter() - t
        assert (first.train == again.train).all() and first.fingerprint == again.fingerprint
        print(json.dumps({"first": first.stats, "again": again.stats, "reload_s": reload_s,
                          "shape": list(first.train.shape), "val": list(first.val.shape)}))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    first, again = res["first"], res["again"]
    assert first["n_docs"] == 38 and first["n_tokens"] > 1_000_000 and first["tokenized"]
    assert again["cached"] and not again["tokenized"] and res["reload_s"] < 5
    assert first["n_blocks"] == first["n_tokens"] // 129 or first["n_blocks"] == (first["n_tokens"] + 38) // 129
    assert res["shape"][1] == 129 and res["val"][0] >= 64 and first["dtype"] == "uint16"
    print(f"\nbundled corpus: {first['n_tokens']:,} tokens, {first['n_blocks']:,} blocks at seq_len 128, "
          f"{first['tokens_per_second']:,} tokens/s, cached reload {res['reload_s']:.2f}s")


# ------------------------------------------------------------------------------------- local formats


def test_local_formats(tmp_path):
    import datasets

    texts = docs(6)
    tok = D.load_tokenizer(None)
    expected = []
    for t in texts:
        expected += tok(t)["input_ids"] + [50256]

    def check(blocks: TokenBlocks, order: list[int] | None = None):
        exp = expected if order is None else sum((tok(texts[i])["input_ids"] + [50256] for i in order), [])
        got = stream(blocks)
        assert blocks.stats["n_docs"] == len(texts)
        assert len(got) == (len(exp) // 17) * 17 and got.tolist() == exp[: len(got)]

    one = tmp_path / "one.txt"  # a .txt file is one document
    one.write_text(texts[0])
    assert build(tmp_path, one, seq_len=8).stats["n_docs"] == 1

    folder = tmp_path / "txt"
    folder.mkdir()
    for i, t in enumerate(texts):
        (folder / f"doc{i:02d}.txt").write_text(t)
    check(build(tmp_path, folder))

    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "body": t}) + "\n" for i, t in enumerate(texts)))
    check(build(tmp_path, jsonl, text_field="body"))

    ds = datasets.Dataset.from_dict({"text": texts, "n": list(range(len(texts)))})
    parquet = tmp_path / "c.parquet"
    ds.to_parquet(str(parquet))
    check(build(tmp_path, parquet))

    saved = tmp_path / "saved"
    ds.save_to_disk(str(saved))
    check(build(tmp_path, saved))

    saved_dict = tmp_path / "saved_dict"
    datasets.DatasetDict({"train": ds.select([5, 4, 3, 2, 1, 0]), "validation": ds}).save_to_disk(str(saved_dict))
    check(build(tmp_path, saved_dict), order=[5, 4, 3, 2, 1, 0])
    check(build(tmp_path, saved_dict, split="validation"))


def test_multiprocess_tokenization_matches(tmp_path):
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs(40)))
    one = build(tmp_path / "a", jsonl, num_proc=1)
    two = build(tmp_path / "b", jsonl, num_proc=2)
    assert np.array_equal(stream(one), stream(two)) and one.fingerprint == two.fingerprint


def test_hub_name_goes_to_datasets(tmp_path, monkeypatch):
    import datasets

    seen = {}

    def fake_load_dataset(name, config=None, split=None, **kw):
        seen.update(name=name, config=config, split=split)
        return datasets.Dataset.from_dict({"text": docs(5)})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    b = build(tmp_path, "someone/some-corpus", data_config="cfg", split="train[:50%]")
    assert seen == {"name": "someone/some-corpus", "config": "cfg", "split": "train[:50%]"} and b.stats["n_docs"] == 5
    seen.clear()
    assert build(tmp_path, "someone/some-corpus", data_config="cfg", split="train[:50%]").stats["cached"] and not seen

    def unreachable(*a, **k):
        raise ConnectionError("Couldn't reach 'nobody/nothing' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(DataError, match="neither a local path nor a loadable Hugging Face dataset"):
        build(tmp_path, "nobody/nothing")


# ---------------------------------------------------------------------------------------------- cache


def make_tokenizer_dir(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train_from_iterator(PARAGRAPHS * 4, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<eos>"]))
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", unk_token="<unk>").save_pretrained(str(path))
    return path


def test_cache_reuse_and_rebuild(tmp_path, monkeypatch):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs(30)))
    first = build(tmp_path, corpus)
    assert first.stats["tokenized"] and not first.stats["cached"]

    def no_tokenizer(self, batch):
        raise AssertionError("the tokenizer ran on a cache hit")

    def not_loaded(name):
        raise AssertionError("the bundled tokenizer was loaded on a cache hit (transformers' import: seconds a run)")

    with monkeypatch.context() as m:
        m.setattr(_Encode, "__call__", no_tokenizer)
        with monkeypatch.context() as m2:
            m2.setattr(cache_module, "load_tokenizer", not_loaded)
            again = build(tmp_path, corpus)
        bundled = D.load_tokenizer(None)  # the facts read from its files are the loaded tokenizer's
        assert tokenizer_facts(None, lambda: bundled)[1:] == (bundled.eos_token_id, len(bundled)) == (first.eos_id, first.vocab_size)
        assert again.stats["cached"] and not again.stats["tokenized"] and again.fingerprint == first.fingerprint
        assert np.array_equal(again.train, first.train)
        longer = build(tmp_path, corpus, seq_len=32)  # new seq_len: re-packed from the cached tokens
        assert not longer.stats["cached"] and not longer.stats["tokenized"] and longer.train.shape[1] == 33
        assert longer.fingerprint != first.fingerprint
        assert np.array_equal(stream(longer), stream(first)[: stream(longer).size])

    tok_dir = make_tokenizer_dir(tmp_path / "tok")
    vocab = len(D.load_tokenizer(str(tok_dir)))
    other_tok = build(tmp_path, corpus, tokenizer=str(tok_dir))
    assert other_tok.stats["tokenized"] and other_tok.fingerprint != first.fingerprint
    assert other_tok.vocab_size == vocab < 300
    assert other_tok.eos_id == 1 and int(stream(other_tok).max()) < vocab

    corpus.write_text(corpus.read_text() + json.dumps({"text": "One more document."}) + "\n")  # size + mtime change
    changed = build(tmp_path, corpus)
    assert changed.stats["tokenized"] and changed.stats["n_docs"] == 31

    bin_path = Path(changed.stats["cache_path"])  # a truncated blocks file is detected and rebuilt
    del changed
    with open(bin_path, "r+b") as f:
        f.truncate(10)
    repaired = build(tmp_path, corpus)
    assert not repaired.stats["cached"] and repaired.stats["n_docs"] == 31


# ------------------------------------------------------------------------------------------- sharding


def test_dp_sharding_3d_layout():
    """(dp, tp, pp) = (2, 2, 2): tp fastest, pp outermost; loaders only see the dp coordinate."""
    blocks = synthetic_blocks()
    dp, tp, pp, G = 2, 2, 2, 8
    ranks = range(dp * tp * pp)
    loaders = {r: BatchLoader(blocks, G, dp_rank=(r // tp) % dp, dp_size=dp, seed=3) for r in ranks}
    ref1 = BatchLoader(blocks, G, 0, 1, seed=3)
    ref4 = [BatchLoader(blocks, G, r, 4, seed=3) for r in range(4)]
    seen_epoch0: list[int] = []
    for step in range(3 * (103 // G)):  # crosses two epoch boundaries
        batches = {r: loaders[r].next_batch().tokens for r in ranks}
        for r in ranks:
            assert batches[r].dtype == torch.int64 and batches[r].shape == (G // dp, 8)
            assert torch.equal(batches[r], batches[(r // tp) % dp * tp])  # tp / pp peers identical
        by_dp = [batches[d * tp] for d in range(dp)]
        assert not set(row_ids(by_dp[0])) & set(row_ids(by_dp[1]))  # dp ranks disjoint
        full = ref1.next_batch().tokens
        assert torch.equal(torch.cat(by_dp), full)  # union over dp == the dp=1 global batch
        assert torch.equal(torch.cat([l.next_batch().tokens for l in ref4]), full)  # ... whatever dp_size is
        if step < 103 // G:
            seen_epoch0 += row_ids(full)
    assert len(set(seen_epoch0)) == len(seen_epoch0) == (103 // G) * G  # no repeats within an epoch
    assert loaders[0].epoch == 2


def test_arrays_or_token_blocks():
    """The loaders take the TokenBlocks or its bare .train / .val arrays, with the same batches."""
    blocks = synthetic_blocks()
    a, b = BatchLoader(blocks, 8, 1, 2, seed=2), BatchLoader(blocks.train, 8, 1, 2, seed=2)
    for _ in range(20):
        assert torch.equal(a.next_batch().tokens, b.next_batch().tokens)
    assert a.state_dict()["fingerprint"] == "synthetic" and b.state_dict()["fingerprint"] != "synthetic"
    assert [t.tokens.tolist() for t in val_batches(blocks, 8, 1, 2)] == [
        t.tokens.tolist() for t in val_batches(blocks.val, 8, 1, 2)]


def test_epochs_reshuffle_and_seed():
    blocks = synthetic_blocks()
    a = BatchLoader(blocks, 10, 0, 1, seed=0)
    epoch0 = [row_ids(a.next_batch().tokens) for _ in range(a.steps_per_epoch)]
    epoch1 = [row_ids(a.next_batch().tokens) for _ in range(a.steps_per_epoch)]
    assert epoch0 != epoch1 and a.epoch == 1
    assert row_ids(BatchLoader(blocks, 10, 0, 1, seed=1).next_batch().tokens) != epoch0[0]
    assert row_ids(BatchLoader(blocks, 10, 0, 1, seed=0).next_batch().tokens) == epoch0[0]


@pytest.mark.parametrize("dp_before,dp_after", [(2, 2), (2, 4), (4, 1), (1, 2)])
def test_resume_exact(dp_before, dp_after):
    blocks = synthetic_blocks()
    G = 8

    def global_batch(loaders):
        return torch.cat([l.next_batch().tokens for l in loaders])

    uninterrupted = [BatchLoader(blocks, G, r, 1, seed=5) for r in range(1)]
    expected = [global_batch(uninterrupted) for _ in range(40)]

    before = [BatchLoader(blocks, G, r, dp_before, seed=5) for r in range(dp_before)]
    for i in range(17):
        assert torch.equal(global_batch(before), expected[i])
    states = [json.loads(json.dumps(l.state_dict())) for l in before]
    assert all(s == states[0] for s in states)  # dp-size independent, plain JSON
    assert set(states[0]) >= {"epoch", "position", "seed", "fingerprint"}

    after = [BatchLoader(blocks, G, r, dp_after, seed=999) for r in range(dp_after)]
    for l in after:
        l.load_state_dict(states[0])
    for i in range(17, 40):  # crosses epoch boundaries (12 steps per epoch)
        assert torch.equal(global_batch(after), expected[i])


def test_resume_refuses_other_data():
    loader = BatchLoader(synthetic_blocks(), 8, 0, 1)
    state = loader.state_dict() | {"fingerprint": "something-else"}
    with pytest.raises(DataError, match="fingerprint"):
        loader.load_state_dict(state)


def test_val_batches():
    blocks = synthetic_blocks(n_val=20)
    full = [b.tokens for b in val_batches(blocks, 8, 0, 1)]
    assert len(full) == 2 and row_ids(torch.cat(full)) == list(range(103, 119))  # in order, partial tail skipped
    for dp in (2, 4):
        shards = [[b.tokens for b in val_batches(blocks, 8, r, dp)] for r in range(dp)]
        for i in range(2):
            assert torch.equal(torch.cat([s[i] for s in shards]), full[i])
    assert len(list(val_batches(blocks, 8, 1, 2, max_batches=1))) == 1
    assert [b.tokens.tolist() for b in val_batches(blocks, 8, 0, 1)] == [b.tolist() for b in full]  # deterministic


def test_val_split_sizes(tmp_path):
    cfg = DataConfig()
    assert _n_val(cfg, 11741) == 128 and _n_val(cfg, 1_000_000) == 10_000  # min 128 blocks, else 1%
    assert _n_val(cfg, 50) == 5 and _n_val(cfg, 2) == 1 and _n_val(DataConfig(val_fraction=0), 50) == 0
    corpus = tmp_path / "c.txt"
    corpus.write_text(" ".join(docs(20)))
    b = build(tmp_path, corpus, val_fraction=0.25)
    assert len(b.val) == round(0.25 * b.stats["n_blocks"]) and len(b.train) + len(b.val) == b.stats["n_blocks"]
    assert np.array_equal(np.concatenate([b.train, b.val]).reshape(-1), stream(b))  # val is the contiguous tail


# ------------------------------------------------------------------------------------------ bad input


def test_bad_inputs(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"text": ""}) + "\n" + json.dumps({"text": ""}) + "\n")
    with pytest.raises(DataError, match="contains no text"):
        build(tmp_path, empty)
    blank = tmp_path / "blank"
    blank.mkdir()
    (blank / "a.txt").write_text("")
    with pytest.raises(DataError, match="contains no text"):
        build(tmp_path, blank)
    with pytest.raises(DataError, match="holds no .txt"):
        build(tmp_path, _mkdir(tmp_path / "nofiles"))

    with pytest.raises(DataError, match="does not exist"):
        build(tmp_path, tmp_path / "missing.jsonl")
    with pytest.raises(DataError, match="does not exist"):
        build(tmp_path, "./no/such/folder/")

    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text(json.dumps({"body": "hello", "title": "t"}) + "\n")
    with pytest.raises(DataError, match=r"no column 'text'.*--text-field.*body, title"):
        build(tmp_path, wrong)
    numeric = tmp_path / "numeric.jsonl"
    numeric.write_text(json.dumps({"text": 3, "body": "hello"}) + "\n")
    with pytest.raises(DataError, match=r"Column 'text' .* is not text .*--text-field to a text column: body"):
        build(tmp_path, numeric)

    tiny = tmp_path / "tiny.txt"
    tiny.write_text("Just a few words.")
    with pytest.raises(DataError, match=r"fewer than one block of seq_len \+ 1 = 129"):
        build(tmp_path, tiny, seq_len=128)

    small = tmp_path / "small.txt"
    small.write_text(" ".join(docs(3)))
    blocks = build(tmp_path, small, seq_len=16)
    n = len(blocks.train)
    with pytest.raises(DataError, match=rf"has {n} blocks of 17 tokens but one global batch needs {n + 1}"):
        BatchLoader(blocks, n + 1, 0, 1)
    short = list(val_batches(blocks, 64, 0, 1))  # a tail shorter than a global batch: what it has, padded
    assert len(short) == 1 and short[0].tokens.shape[0] == 64 and len(blocks.val) < 64
    assert int(short[0].supervised.sum()) == short[0].targets == len(blocks.val) * 16
    with pytest.raises(DataError, match="validation split is empty"):
        val_batches(blocks.train[:0], 4, 0, 1)
    with pytest.raises(DataError, match="multiple of 4"):
        BatchLoader(blocks, 6, 0, 4)

    with pytest.raises(DataError, match="at most 1024"):
        D.check_seq_len(2048, 1024)
    D.check_seq_len(1024, 1024)

    with pytest.raises(DataError, match="Could not load tokenizer"):
        build(tmp_path, small, tokenizer=str(tmp_path / "no-tokenizer-here"))
    assert issubclass(DataError, ValueError)


def _mkdir(p: Path) -> Path:
    p.mkdir()
    (p / "notes.md").write_text("not a corpus file")
    return p
