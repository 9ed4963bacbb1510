"""Sampling (trainer3d/generate.py, trainer3d/sample.py, model.KVCache): the cache changes speed, never the result.

On a tiny random model in fp32, the logits of cached decoding equal a full recompute of the whole prefix at every
step, and greedy generation equals the argmax of full recomputation; the context and end-of-text rules hold. The
command is run on a real checkpoint (a 2-step training run in a subprocess) and on its Hugging Face export: a seed
prints the same text every time, another seed other text, and bad input is one line and exit code 2.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.distributed import launch_env
from trainer3d.generate import generate, new_token_budget, pick_next_token
from trainer3d.models.attention import KVCache
from trainer3d.models.gpt2 import GPT, GPTConfig

REPO = Path(__file__).resolve().parent.parent
CFG = GPTConfig(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4)


def _model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(CFG).eval()
    with torch.no_grad():  # biases and LayerNorms away from their (symmetric) initial values
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@torch.no_grad()
def test_cached_logits_equal_full_recompute_at_every_step():
    model = _model()
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(0, CFG.vocab_size, (2, 5), generator=g)
    cache = KVCache(max_len=CFG.n_positions)
    cached = model(seq, kv_cache=cache)  # prefill: every prompt position
    torch.testing.assert_close(cached, model(seq), rtol=0, atol=1e-5)
    while seq.shape[1] < CFG.n_positions - 3:
        nxt = torch.randint(0, CFG.vocab_size, (2, 1), generator=g)
        seq = torch.cat([seq, nxt], dim=1)
        torch.testing.assert_close(model(nxt, kv_cache=cache)[:, -1], model(seq)[:, -1], rtol=0, atol=1e-5)
    assert cache.length == seq.shape[1]
    chunk = torch.randint(0, CFG.vocab_size, (2, 3), generator=g)  # several new positions at once: the masked path
    seq = torch.cat([seq, chunk], dim=1)
    torch.testing.assert_close(model(chunk, kv_cache=cache), model(seq)[:, -3:], rtol=0, atol=1e-5)
    assert cache.length == CFG.n_positions
    with pytest.raises(ValueError, match="KV cache of 4 positions is full"):
        model(seq[:, :5], kv_cache=KVCache(max_len=4))


@torch.no_grad()
def test_greedy_generation_equals_argmax_of_full_recompute():
    model = _model(seed=2)
    prompt = torch.tensor([[5, 17, 3], [40, 2, 96]])
    out = generate(model, prompt, max_new_tokens=20, temperature=0)
    assert out.shape == (2, 23) and torch.equal(out[:, :3], prompt)
    seq = prompt
    for _ in range(20):
        seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)


@torch.no_grad()
def test_context_and_eos_rules():
    model = _model(seed=3)
    prompt = torch.tensor([[1, 2, 3, 4]])
    # The sequence stops at n_positions tokens, whatever max_new_tokens asks.
    assert new_token_budget(4, 1000, CFG.n_positions) == CFG.n_positions - 4
    assert generate(model, prompt, 1000, temperature=0).shape == (1, CFG.n_positions)
    assert generate(model, torch.zeros(1, CFG.n_positions, dtype=torch.long), 5).shape == (1, CFG.n_positions)
    # EOS: a row stops at it and is padded with it; generation ends when every row has stopped.
    prompts = torch.tensor([[1, 2, 3, 4], [9, 8, 7, 6]])
    greedy = generate(model, prompts, 8, temperature=0)
    eos = int(greedy[0, 4])  # row 0's first new token
    out = generate(model, prompts, 8, temperature=0, eos_id=eos)
    expected = []
    for row in greedy[:, 4:].tolist():
        stop = row.index(eos) + 1 if eos in row else len(row)
        expected.append(row[:stop])
    n = max(len(r) for r in expected)
    assert out.shape == (2, 4 + n) and out[0, 4:].tolist() == [eos] * n
    assert out[:, 4:].tolist() == [r + [eos] * (n - len(r)) for r in expected]


def test_pick_next_token():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(pick_next_token(logits, 0.0), logits.argmax(-1))
    assert torch.equal(pick_next_token(logits, 1.0, top_k=1, generator=torch.Generator()), logits.argmax(-1))
    draws = [pick_next_token(logits, 0.9, 5, torch.Generator().manual_seed(7)) for _ in range(2)]
    assert torch.equal(draws[0], draws[1])
    top5 = torch.topk(logits, 5).indices
    many = torch.stack([pick_next_token(logits, 2.0, 5, torch.Generator().manual_seed(s)) for s in range(50)])
    assert all(bool((many[:, r, None] == top5[r]).any(-1).all()) for r in range(3))  # only the top 5 are drawn


# ---- the command -------------------------------------------------------------------------------------------------
WORDS = "the king and queen of a small castle were walking in gardens under bright summer skies".split()


def _env(**extra) -> dict[str, str]:
    return launch_env(TQDM_DISABLE="1", **extra)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A real checkpoint: 2 training steps of a small model on a small corpus."""
    d = tmp_path_factory.mktemp("sample")
    rng = random.Random(0)
    (d / "small.txt").write_text("\n\n".join(" ".join(rng.choice(WORDS) for _ in range(200)) for _ in range(20)))
    args = ["--model", "tiny", "--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--global-batch", "4",
            "--seq-len", "32", "--eval-every", "0", "--max-steps", "2", "--save-every", "2",
            "--data", str(d / "small.txt"), "--out-dir", str(d / "run")]
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "train_gpt2.py"), *args], env=_env(
        TRAINER3D_CACHE=str(d / "cache")), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return d / "run"


def _sample(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer3d.sample", *map(str, args)], env=_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def _texts(stdout: str) -> list[str]:
    """The samples' texts, without their header lines."""
    chunks = stdout.split("--- sample ")[1:]
    return [c.split("---\n", 1)[1] for c in chunks]


def test_same_seed_same_text(run_dir):
    args = [run_dir, "--prompt", "The king", "--max-new-tokens", "24", "--num-samples", "2", "--top-k", "50"]
    first, again, other = _sample(*args, "--seed", 1), _sample(*args, "--seed", 1), _sample(*args, "--seed", 2)
    for p in (first, again, other):
        assert p.returncode == 0, p.stderr
    assert first.stdout == again.stdout
    texts = _texts(first.stdout)
    assert len(texts) == 2 and all(t.startswith("The king") and len(t) > len("The king") + 10 for t in texts)
    assert texts[0] != texts[1]  # two draws from one seeded stream
    assert _texts(other.stdout) != texts


def test_hf_export_samples_the_same_text(run_dir, tmp_path, capsys):
    from trainer3d.export import export
    from trainer3d.sample import main

    hf = export(run_dir, tmp_path / "hf")
    args = ["--prompt", "a small castle", "--max-new-tokens", "16", "--seed", "5"]
    assert main([str(run_dir), *args]) == 0
    from_checkpoint = capsys.readouterr().out
    assert main([str(hf), *args]) == 0
    assert capsys.readouterr().out == from_checkpoint


def test_bad_input_is_one_sentence_and_exit_2(run_dir, tmp_path, capsys):
    from trainer3d.sample import main

    not_ckpt = _sample(tmp_path, "--prompt", "hi")  # a real process: exit code 2, one line, no traceback
    assert not_ckpt.returncode == 2 and not_ckpt.stdout == ""
    assert not_ckpt.stderr.startswith("trainer3d: error: ") and not_ckpt.stderr.count("\n") == 1, not_ckpt.stderr
    assert "is not a complete checkpoint" in not_ckpt.stderr
    cases = [
        ([tmp_path / "missing"], "does not exist"),
        ([run_dir, "--temperature", "-0.5"], "--temperature must be a finite number at least 0 (got -0.5)."),
        ([run_dir, "--temperature", "nan"], "--temperature must be a finite number at least 0 (got nan)."),
        ([run_dir, "--top-k", "0"], "--top-k must be at least 1 (got 0)."),
        ([run_dir, "--max-new-tokens", "0"], "--max-new-tokens must be at least 1 (got 0)."),
        ([run_dir, "--num-samples", "-1"], "--num-samples must be at least 1 (got -1)."),
        ([run_dir, "--seed", "-1"], "--seed must be in [0, 9223372036854775807] (got -1)."),
        ([run_dir, "--prompt", " ".join(["the king"] * 200)],
         "--prompt is 400 tokens but the model's context is 256 positions; shorten it to at most 255 tokens."),
        ([run_dir, "--top-k", "many"], "argument --top-k: invalid int value: 'many'"),
    ]
    for argv, sentence in cases:
        try:
            rc = main([str(a) for a in argv])
        except SystemExit as e:  # argparse's own errors exit from inside
            rc = e.code
        captured = capsys.readouterr()
        assert rc == 2, (argv, captured.err)
        assert captured.err.startswith("trainer3d: error: ") and captured.err.count("\n") == 1, (argv, captured.err)
        assert sentence in captured.err and captured.out == "", (argv, captured.err)
