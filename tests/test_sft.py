"""Supervised fine-tuning on chat data: the loss masks (the assistant spans by rendering prefixes, the template's
{% generation %} tags where it has them, refusals instead of guesses), the packed rows (conversations whole, an
end-of-text inside one splitting nothing, padding in no loss), and the user's whole loop: a random Hugging Face Llama
with a chat tokenizer, fine-tuned at tp 2 × pp 2, resumed exactly, evaluated at dp 2 × tp 2 on the chat file and on
a text corpus, exported, and read back by transformers: its mean cross-entropy over the assistant tokens (masks written
here from the rule) equals `trainer3d.evaluate --data-format chat`'s, over the text corpus's rows the plain
evaluation's, and its chat generation equals `trainer3d.sample --chat`'s.
(Packed = unpacked = any layout, ZeRO-3 included, per step in loss and gradient norm: test_parity.py's world of 4 and
test_zero.py's world of 2.)"""

from __future__ import annotations

import json

import datasets
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers

from helpers.chat_data import chat_jsonl, chat_tokenizer, conversations, template
from helpers.distributed import run_world
from test_llama import hf_llama
from trainer3d.data.chat import BadRow, Conversation, MaskRule, encode
from trainer3d.data.sft import build_chat_rows
from trainer3d.data.sources import DataConfig


def rule_mask(tok, messages) -> tuple[list[int], list[int]]:
    """The prefix rule, written here from its words: a token is supervised iff its characters overlap the span that
    render(messages[:i+1]) adds to render(messages[:i], add_generation_prompt=True), i an assistant turn
    (transformers' rule for a token across a boundary)."""
    text = tok.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            before = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
            spans.append((len(before), len(tok.apply_chat_template(messages[: i + 1], tokenize=False))))
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(s < b and e > a for a, b in spans)) for s, e in enc["offset_mapping"]]
    return enc["input_ids"], mask


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    out = {}
    for tags in (False, True):
        chat_tokenizer(root / str(tags), tags)
        out[tags] = transformers.AutoTokenizer.from_pretrained(root / str(tags))
    return out


def test_masks_follow_the_rule_and_the_generation_tags(toks):
    """Both templates: our masks are the rule's; with tags, transformers' assistant_masks are the same masks; the
    supervised text is exactly the assistant turns' content and their closing tokens."""
    for tags, tok in toks.items():
        for row, messages in enumerate(conversations(25, seed=3)):
            ids, flags = encode(tok, Conversation(messages), MaskRule())
            ref_ids, ref_mask = rule_mask(tok, messages)
            assert ids.tolist() == ref_ids and flags.tolist() == ref_mask, (tags, row)
            expected = "".join(m["content"] + "<|end_of_text|>\n" for m in messages if m["role"] == "assistant")
            assert tok.decode(ids[flags == 1]) == expected
            if tags:
                out = tok.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
                assert out["assistant_masks"] == ref_mask
    ids, flags = encode(toks[False], Conversation(conversations(1)[0]), MaskRule("all"))
    assert flags.all()


def test_underivable_spans_are_bad_rows(toks):
    tok = toks[False]
    tok.chat_template = "{{ messages|length }}" + template()  # a prefix renders another count: no span can be cut
    with pytest.raises(BadRow, match="^the chat template renders the conversation up to its turn 1 differently"):
        encode(tok, Conversation(conversations(5)[4]), MaskRule())
    ids, flags = encode(tok, Conversation(conversations(5)[4]), MaskRule("all"))  # all tokens: no spans needed
    assert flags.all()


def test_rows_hold_whole_conversations(tmp_path):
    """Packed rows: each conversation whole in one row, a document of its own though it holds end-of-text tokens,
    its first token never a target, padding a document in no loss; --no-pack holds the same conversations one per
    row; longer ones truncated or dropped, counted."""
    chat_tokenizer(tmp_path / "tok")
    data = chat_jsonl(tmp_path / "c.jsonl", 60, seed=4)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    convs = [encode(tok, Conversation(m), MaskRule()) for m in conversations(60, seed=4)]
    base = dict(data=str(data), tokenizer=str(tmp_path / "tok"), format="chat", cache_dir=str(tmp_path / "cache"),
                val_fraction=0.0)
    seq = max(len(ids) for ids, _ in convs) + 8
    packed = build_chat_rows(DataConfig(**base), seq).train
    saved = tmp_path / "saved"  # the same conversations from a save_to_disk directory: the same rows
    datasets.Dataset.from_list([{"messages": m} for m in conversations(60, seed=4)]).save_to_disk(str(saved))
    assert np.array_equal(build_chat_rows(DataConfig(**dict(base, data=str(saved))), seq).train.tokens, packed.tokens)
    unpacked = build_chat_rows(DataConfig(**base, pack=False), seq).train
    assert len(unpacked) == 60 and len(packed) < 40
    eos = tok.eos_token_id
    for rows in (packed, unpacked):
        found = []
        for r in range(len(rows)):
            docs, tokens, flags = rows.documents[r], rows.tokens[r], rows.flags[r]
            for d in np.unique(docs):
                at = np.flatnonzero(docs == d)
                assert (np.diff(at) == 1).all()  # contiguous
                if tokens[at[0]] == tok.pad_token_id:
                    assert not flags[at].any()
                    continue
                assert (tokens[at] == eos).sum() >= 2 and flags[at[0]] == 0  # end-of-text inside, not split on
                found.append((tokens[at].tolist(), flags[at].tolist()))
        want = [(ids.tolist(), [0] + flags[1:].tolist()) for ids, flags in convs]
        assert sorted(found) == sorted(want) and (rows is packed or found == want)  # packed: best-fit decreasing
        assert rows.counts.sum() == sum(f[1:].sum() for _, f in convs)
    short = max(len(ids) for ids, _ in convs) - 5
    n_long = sum(len(ids) > short + 1 for ids, _ in convs)
    assert n_long > 0
    for overlong in ("truncate", "drop"):
        blocks = build_chat_rows(DataConfig(**base, overlong=overlong), short)
        assert blocks.stats["truncated" if overlong == "truncate" else "dropped"] == n_long


# ---- the user's loop: import, fine-tune, resume, evaluate, export, chat ------------------------------------------------
STEPS, SEQ, GB = 4, 192, 4  # SEQ: every conversation whole (none truncated)


def _loop(rank: int, world_size: int, hf_dir: str, data: str, runs: dict, evaluations: dict) -> dict:
    """Every run's exit code (the training entry point at tp 2 × pp 2, then trainer3d.evaluate at dp 2 × tp 2)."""
    from trainer3d.evaluate import main as evaluate_main
    from trainer3d.train.loop import main as train_main

    common = ["--init-from-hf", hf_dir, "--data", data, "--data-format", "chat", "--seq-len", str(SEQ),
              "--global-batch", str(GB), "--tp", "2", "--pp", "2", "--lr", "3e-3", "--warmup-steps", "1",
              "--eval-every", "0", "--grad-clip", "1.0", "--log-every", "1"]
    codes = {name: train_main(common + argv) for name, argv in runs}
    codes.update({name: evaluate_main(argv) for name, argv in evaluations.items()})
    return codes


def test_sft_from_an_hf_llama_to_an_export_that_chats(tmp_path, capsys):
    from trainer3d.export import main as export_main
    from trainer3d.sample import main as sample_main

    hf_dir = tmp_path / "hf"
    hf_llama(tie=True, seed=5).save_pretrained(hf_dir)
    chat_tokenizer(hf_dir)  # the directory's tokenizer is the run's: its chat template renders the conversations
    data = chat_jsonl(tmp_path / "chat.jsonl", 120, seed=6)
    whole, part = tmp_path / "whole", tmp_path / "part"
    runs = [("whole", ["--max-steps", str(STEPS), "--out-dir", str(whole)]),
            ("part", ["--max-steps", "2", "--out-dir", str(part)]),
            ("resumed", ["--max-steps", str(STEPS), "--out-dir", str(part), "--resume"])]
    report, text_report = tmp_path / "eval.json", tmp_path / "text.json"
    texts = [" ".join(m["content"] for m in c) for c in conversations(30, seed=8)]
    corpus = tmp_path / "text.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    at = ["--tp", "2", "--global-batch", "4"]
    evaluations = {"chat": [str(whole), "--data", str(data), "--data-format", "chat", *at, "--output", str(report)],
                   "text": [str(whole), "--data", str(corpus), *at, "--output", str(text_report)]}
    codes = run_world(4, _loop, str(hf_dir), str(data), runs, evaluations, timeout=600)
    assert codes[0] == {"whole": 0, "part": 0, "resumed": 0, "chat": 0, "text": 0}, codes
    metrics = {name: [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
               for name, d in (("whole", whole), ("part", part))}
    assert [r["loss"] for r in metrics["part"] if "loss" in r] == [r["loss"] for r in metrics["whole"] if "loss" in r]

    assert export_main([str(whole), str(tmp_path / "export")]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    assert tok.chat_template == template()  # the export chats with the run's template
    total, count, all_total, all_count = 0.0, 0, 0.0, 0
    with torch.no_grad():
        for messages in conversations(120, seed=6):
            ids, mask = rule_mask(tok, messages)
            x = torch.tensor([ids])
            losses = F.cross_entropy(model(x).logits[0, :-1].double(), x[0, 1:], reduction="none")
            keep = torch.tensor(mask[1:], dtype=torch.bool)
            total, count = total + losses[keep].sum().item(), count + int(keep.sum())
            all_total, all_count = all_total + losses.sum().item(), all_count + len(losses)
    got = json.loads(report.read_text())
    assert got["rows"] < 120 and got["tokens"] == count and got["layout"]["dp"] == 2 and got["layout"]["tp"] == 2
    assert abs(got["loss"] - total / count) <= 1e-5 * total / count, (got["loss"], total / count)
    assert abs(all_total / all_count - total / count) > 0.05  # the mask matters: the all-token loss differs
    with capsys.disabled():
        print(f"\nassistant tokens ({count}): trainer3d.evaluate {got['loss']:.8f}, transformers {total / count:.8f} "
              f"(relative {abs(got['loss'] - total / count) / (total / count):.1e}); all {all_count} tokens "
              f"{all_total / all_count:.6f}")

    # a text corpus: documents, each followed by the end-of-text token, cut into rows of SEQ + 1 tokens
    stream = [i for t in texts for i in tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
    rows = torch.tensor(stream[: len(stream) // (SEQ + 1) * (SEQ + 1)]).view(-1, SEQ + 1)
    with torch.no_grad():
        text_loss = F.cross_entropy(model(rows[:, :-1]).logits.double().flatten(0, 1), rows[:, 1:].flatten()).item()
    got = json.loads(text_report.read_text())
    assert got["tokens"] == rows[:, 1:].numel() and abs(got["loss"] - text_loss) <= 1e-5 * text_loss, (got, text_loss)
    with capsys.disabled():
        print(f"text corpus ({got['tokens']} tokens): trainer3d.evaluate {got['loss']:.8f}, transformers {text_loss:.8f}")

    prompt = "what light through yonder window breaks"
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    greedy = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)[0, ids.shape[1]:]
    reply = greedy.tolist()
    reply = reply[: reply.index(tok.eos_token_id)] if tok.eos_token_id in reply else reply
    capsys.readouterr()
    assert sample_main([str(whole), "--chat", "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "12"]) == 0
    printed = capsys.readouterr().out.split("\n", 1)[1][:-1]  # after the header, without print's newline
    assert printed == tok.decode(reply), (printed, reply)
