"""Chat data as people publish it, offline: published templates on multi-turn rows (each row trains with the mask its
template's own rule gives, or is dropped and counted: a run never aborts on one row), tool calls, ShareGPT and
prompt/completion rows, bad rows named or refused, --train-on last and --train-roles, best-fit-decreasing packing and
validation from another file. The masks here are written from each template's documented turn format, not from
trainer3d's code; TRL's tagged templates are checked against TRL itself in test_sft_trl.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import transformers
import trl

from helpers.chat_data import chat_jsonl, chat_tokenizer, conversations
from trainer3d.data.chat import Conversation, MaskRule, encode
from trainer3d.data.packing import best_fit_decreasing
from trainer3d.data.sft import build_chat_rows, build_rows, describe
from trainer3d.data.sources import DataConfig
from trainer3d.errors import DataError

TRL = Path(trl.__file__).parent / "chat_templates"
OURS = Path(__file__).parent / "assets" / "chat_templates"
MARKERS = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<start_of_turn>", "<end_of_turn>", "[INST]",
           "[/INST]", "<|user|>", "<|assistant|>", "<|system|>")
EOS = "<|end_of_text|>"
# template: (its file, what it writes around an assistant's reply as the reply's own tokens, rows it cannot mask)
PUBLISHED = {
    "qwen3": (TRL / "qwen3.jinja", "<think>\n\n</think>\n\n{}<|im_end|>\n", "multi-turn"),  # strips earlier reasoning
    "qwen2.5": (TRL / "qwen2_5.jinja", "{}<|im_end|>\n", None),
    "llama3.1": (TRL / "llama3_1.jinja", "{}<|eot_id|>", None),
    "gemma3": (TRL / "gemma3.jinja", "{}<end_of_turn>\n", None),
    "mistral": (OURS / "mistral_v0.3.jinja", " {}" + EOS, "system"),  # the system prompt joins the last user turn
    "olmo2": (OURS / "olmo2.jinja", "{}" + EOS, None),  # a reply's newline after eos opens the next turn
}


def tokenizer(directory: Path, template: str):
    chat_tokenizer(directory, chat_template=template, specials=MARKERS)
    return transformers.AutoTokenizer.from_pretrained(directory)


def unmaskable(kind: str | None, messages: list[dict]) -> bool:
    if kind == "multi-turn":
        return sum(m["role"] == "assistant" for m in messages) > 1
    return kind == "system" and messages[0]["role"] == "system"


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_templates_mask_their_replies_or_drop_the_row(name, tmp_path):
    """Every assistant reply supervised as its template writes it (--train-on assistant), or only the last reply
    (--train-on last); rows the prefix rule cannot mask are the ones the template's quirk predicts, and a corpus of
    them builds, counting them, where it aborted before."""
    path, reply, quirk = PUBLISHED[name]
    tok = tokenizer(tmp_path / "tok", path.read_text())
    convs = conversations(24, seed=11)
    for messages in convs:
        replies = [reply.format(m["content"]) for m in messages if m["role"] == "assistant"]
        for rule, want in ((MaskRule(), "".join(replies)), (MaskRule("last"), replies[-1])):
            if unmaskable(quirk, messages) and (rule.train_on == "assistant" or quirk == "system"):
                with pytest.raises(DataError, match="renders the conversation up to its turn"):
                    encode(tok, Conversation(messages), rule)
                continue
            ids, flags = encode(tok, Conversation(messages), rule)
            assert tok.decode(ids[flags == 1]) == want, (name, rule.train_on)
    data = chat_jsonl(tmp_path / "c.jsonl", 24, seed=11)
    cfg = DataConfig(data=str(data), tokenizer=str(tmp_path / "tok"), format="chat", cache_dir=str(tmp_path / "cache"),
                     val_fraction=0.0)
    stats = build_chat_rows(cfg, 512).stats
    assert stats["bad"] == sum(unmaskable(quirk, m) for m in convs) and stats["conversations"] == 24
    assert (stats["bad"] > 0) == (quirk is not None)
    if stats["bad"]:
        assert f"row {stats['bad_examples'][0][0]}: the chat template renders" in describe(stats)


def test_tool_calls_shapes_and_roles(tmp_path):
    """A tool-calling row (content null, a tools column, Arrow's null-filled keys) trains, its call supervised;
    ShareGPT rows and conversational prompt/completion rows give the rows plain messages give; plain prompt/completion
    texts are prompt + completion + eos, the completion and eos supervised; --train-roles adds a role's turns."""
    tok_dir = tmp_path / "tok"
    tok = tokenizer(tok_dir, (TRL / "qwen2_5.jinja").read_text())
    tools = [{"type": "function", "function": {"name": "weather", "description": "the weather in a city",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "verona"}}}
    row = [{"role": "user", "content": "is the sun out"}, {"role": "assistant", "content": None, "tool_calls": [call]},
           {"role": "tool", "content": "the sun"}, {"role": "assistant", "content": [{"type": "text", "text": "it is"}]}]
    tool_file = tmp_path / "tools.jsonl"
    tool_file.write_text(json.dumps({"messages": row, "tools": tools}) + "\n" + json.dumps(
        {"messages": conversations(1, seed=2)[0], "tools": None}) + "\n")
    base = dict(tokenizer=str(tok_dir), format="chat", cache_dir=str(tmp_path / "cache"), val_fraction=0.0, pack=False)
    rows = build_chat_rows(DataConfig(data=str(tool_file), **base), 1500).train
    first = rows.tokens[0][rows.flags[0] == 1]
    want = '\n<tool_call>\n{"name": "weather", "arguments": {"city": "verona"}}\n</tool_call><|im_end|>\nit is<|im_end|>\n'
    assert tok.decode(first) == want.lstrip("\n")  # the prefix rule: the reply starts after "assistant\n"
    assert "# Tools" in tok.decode(rows.tokens[0][: rows.lengths[0]])  # the schema reached the template

    convs = conversations(6, seed=3)
    plain = build_chat_rows(DataConfig(data=str(chat_jsonl(tmp_path / "m.jsonl", 6, seed=3)), **base), 300).train
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    share = tmp_path / "share.jsonl"
    share.write_text("".join(json.dumps({"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in c]})
                             + "\n" for c in convs))
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": c[:-1], "completion": c[-1:]}) + "\n" for c in convs))
    for data, fmt in ((share, "sharegpt"), (pairs, "chat")):
        got = build_chat_rows(DataConfig(data=str(data), **dict(base, format=fmt)), 300).train
        last_only = build_chat_rows(DataConfig(data=str(tmp_path / "m.jsonl"), train_on="last", **base), 300).train
        want_flags = plain.flags if fmt == "sharegpt" else last_only.flags  # a completion is the last reply
        assert np.array_equal(got.tokens, plain.tokens) and np.array_equal(got.flags, want_flags), fmt

    texts = tmp_path / "texts.jsonl"
    texts.write_text(json.dumps({"prompt": "the king is", "completion": " dead"}) + "\n")
    got = build_chat_rows(DataConfig(data=str(texts), **base), 30).train
    ids = tok("the king is dead")["input_ids"] + [tok.eos_token_id]
    assert got.tokens[0][: len(ids)].tolist() == ids and tok.decode(got.tokens[0][got.flags[0] == 1]) == " dead" + EOS

    chat_tokenizer(tmp_path / "plain")  # ours: no default system turn, so a first user turn adds only itself
    plain_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "plain")
    with_users = build_chat_rows(DataConfig(data=str(tmp_path / "m.jsonl"), train_roles="assistant,user",
                                            **dict(base, tokenizer=str(tmp_path / "plain"))), 300).train
    for r, c in enumerate(convs):  # another role's turn: all it adds, its header too; a reply: after the prompt
        supervised = plain_tok.decode(with_users.tokens[r][with_users.flags[r] == 1])
        want = "".join(("<|im_start|>user\n" if m["role"] == "user" else "") + m["content"] + EOS + "\n"
                       for m in c if m["role"] != "system")
        assert supervised == (want[len("<|im_start|>"):] if c[0]["role"] == "user" else want)  # a row's first token


def test_bad_rows_are_dropped_named_or_refused(tmp_path):
    """An unknown role, a row with no reply, a template's own error and a row whose replies are cut off by --seq-len are
    bad rows: dropped and named, or the run's error with --on-bad-row error; data with nothing supervised is refused."""
    tok_dir = tmp_path / "tok"
    tokenizer(tok_dir, (TRL / "gemma3.jinja").read_text())
    good = conversations(3, seed=5)
    long_prompt = [{"role": "user", "content": "the king " * 40}, {"role": "assistant", "content": "long live"}]
    rows = [good[0], [{"role": "robot", "content": "beep"}, {"role": "assistant", "content": "x"}],
            [{"role": "user", "content": "hello"}], good[1],
            [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}],
            long_prompt, good[2]]
    data = tmp_path / "bad.jsonl"
    data.write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows))
    base = dict(data=str(data), tokenizer=str(tok_dir), format="chat", cache_dir=str(tmp_path / "cache"),
                val_fraction=0.0)
    stats = build_chat_rows(DataConfig(**base), 64).stats
    assert stats["bad"] == 4 and stats["conversations"] == 7 and stats["truncated"] >= 1
    assert [r for r, _ in stats["bad_examples"]] == [1, 2, 4]
    reasons = [why for _, why in stats["bad_examples"]]
    assert "role 'robot'" in reasons[0] and "no supervised token" in reasons[1]
    assert "the chat template fails on it (TemplateError: Conversation roles must alternate" in reasons[2]
    assert "4 dropped as bad rows (row 1: it has a message of role 'robot'" in describe(stats)
    with pytest.raises(DataError, match=r"^Row 1 of the chat data .*role 'robot'.*--on-bad-row drop"):
        build_chat_rows(DataConfig(**base, on_bad_row="error"), 64)
    nothing = tmp_path / "nothing.jsonl"
    nothing.write_text(json.dumps({"messages": rows[2]}) + "\n")
    with pytest.raises(DataError, match="holds no supervised token"):
        build_chat_rows(DataConfig(**dict(base, data=str(nothing))), 64)


def test_best_fit_decreasing_and_validation_from_another_file(tmp_path):
    """BFD: deterministic, every conversation once, no row over capacity, fuller than filling rows in order;
    --val-data: every row of the other file is the validation split, the training file none."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 200, size=500)
    plan = best_fit_decreasing(lengths, 257)
    assert sorted(i for row in plan for i in row) == list(range(500))
    assert max(sum(lengths[row]) for row in plan) <= 257 and plan == best_fit_decreasing(lengths, 257)
    in_order, room = 1, 257
    for n in lengths:
        in_order, room = (in_order, room - n) if n <= room else (in_order + 1, 257 - n)
    assert lengths.sum() / (257 * len(plan)) > 0.97 > lengths.sum() / (257 * in_order)

    chat_tokenizer(tmp_path / "tok")
    base = dict(tokenizer=str(tmp_path / "tok"), format="chat", cache_dir=str(tmp_path / "cache"), pack=False)
    train, val = chat_jsonl(tmp_path / "t.jsonl", 10, seed=1), chat_jsonl(tmp_path / "v.jsonl", 3, seed=2)
    blocks = build_rows(DataConfig(data=str(train), val_data=str(val), **base), 200)
    assert len(blocks.train) == 10 and len(blocks.val) == 3 and blocks.stats["n_val"] == 3
    alone = build_rows(DataConfig(data=str(val), val_fraction=0.0, **base), 200)
    assert np.array_equal(blocks.val.tokens, alone.train.tokens)
