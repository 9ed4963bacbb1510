"""Rebuild GPT-2's byte-level BPE tokenizer files from ``gpt2.tiktoken``.

This script was run ONCE to produce ``trainer3d/assets/gpt2_tokenizer/``
(``vocab.json``, ``merges.txt``, ``tokenizer_config.json``,
``special_tokens_map.json``); those files are committed, so nothing here runs
at training time and no network is needed afterwards.

Source: the ``openai-whisper`` sdist ships ``whisper/assets/gpt2.tiktoken``,
OpenAI's GPT-2 BPE as ``base64(token bytes) rank`` lines (ranks 0..50255;
``<|endoftext|>`` is 50256). To regenerate::

    pip download --no-deps --no-binary :all: openai-whisper -d /tmp/whisper
    tar xzf /tmp/whisper/openai_whisper-*.tar.gz -C /tmp/whisper
    python trainer3d/assets/rebuild_gpt2_tokenizer.py \\
        /tmp/whisper/openai_whisper-*/whisper/assets/gpt2.tiktoken

How: GPT-2's ``encoder.json`` maps each token, written with the byte->unicode
table of OpenAI's ``encoder.py`` (``bytes_to_unicode``), to its rank; the
tiktoken ranks are the same numbers (tiktoken's ``data_gym_to_mergeable_bpe_ranks``
checks exactly this). Merge ``i`` of ``merges.txt`` creates the token of rank
``256 + i``; its two halves are recovered by running BPE on that token's bytes
using only merges of lower rank, which leaves exactly two parts. The result
encodes "Hello world" as [15496, 995] and agrees with tiktoken's encoding of
the same ranks (checked on the whole bundled Shakespeare corpus). The two files
are byte-identical to OpenAI's GPT-2 ``vocab.json``/``merges.txt``: their md5s
are the ones KerasNLP's GPT-2 presets (and fairseq's/OPT's notes) publish for
those files; the script checks them at the end.
"""

from __future__ import annotations

import base64
import hashlib
import json
import sys
from pathlib import Path

EOS = "<|endoftext|>"
EXPECTED_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# md5 of OpenAI's GPT-2 files as published by KerasNLP (gpt2_base "vocabulary_hash" / "merges_hash").
OPENAI_MD5 = {"vocab.json": "dffec25a898b1f5e569bec4dffd7e5c0", "merges.txt": "75a37753dd7a28a2c5df80c28bf06e4e"}


def bytes_to_unicode() -> dict[int, str]:
    """OpenAI GPT-2 ``encoder.py``: reversible byte -> printable unicode char."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def _bpe(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    parts = [bytes([b]) for b in token]
    while True:
        best_i, best_rank = -1, max_rank
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best_rank:
                best_i, best_rank = i, r
        if best_i < 0:
            return parts
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]


def rebuild(tiktoken_path: Path, out_dir: Path) -> None:
    raw = tiktoken_path.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    if digest != EXPECTED_SHA256:
        print(f"warning: {tiktoken_path} sha256 {digest} differs from the expected {EXPECTED_SHA256}")
    ranks: dict[bytes, int] = {}
    for line in raw.splitlines():
        if line.strip():
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    by_rank = sorted(ranks.items(), key=lambda kv: kv[1])
    assert [r for _, r in by_rank] == list(range(len(by_rank))), "ranks are not 0..N-1"

    b2u = bytes_to_unicode()

    def u(b: bytes) -> str:
        return "".join(b2u[x] for x in b)

    # First 256 ranks are the single bytes in bytes_to_unicode order.
    assert all(len(tok) == 1 for tok, _ in by_rank[:256])
    assert [tok[0] for tok, _ in by_rank[:256]] == list(b2u.keys())

    vocab = {u(tok): rank for tok, rank in by_rank}
    vocab[EOS] = len(by_rank)  # 50256
    merges = []
    for tok, rank in by_rank[256:]:
        parts = _bpe(ranks, tok, max_rank=rank)
        assert len(parts) == 2, (tok, rank, parts)
        merges.append(f"{u(parts[0])} {u(parts[1])}")

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")  # ASCII-escaped, as OpenAI's encoder.json
    (out_dir / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    special = {"bos_token": EOS, "eos_token": EOS, "unk_token": EOS}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    config = {
        "tokenizer_class": "GPT2Tokenizer",
        "model_max_length": 1024,
        "add_prefix_space": False,
        "add_bos_token": False,
        "errors": "replace",
        **special,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"wrote {len(vocab)} tokens and {len(merges)} merges to {out_dir}")
    for name, md5 in OPENAI_MD5.items():
        got = hashlib.md5((out_dir / name).read_bytes()).hexdigest()
        print(f"{name}: md5 {got} {'matches' if got == md5 else 'DIFFERS FROM'} OpenAI's file")


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    src = Path(sys.argv[1])
    dst = Path(sys.argv[2]) if len(sys.argv) == 3 else Path(__file__).resolve().parent / "gpt2_tokenizer"
    rebuild(src, dst)
