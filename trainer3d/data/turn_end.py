"""The tokens that end a reply, for the export's generation config and `trainer3d.sample --chat`.

A chat model learns to close its turn with whatever the chat template writes after an assistant's content: Qwen's
`<|im_end|>`, Llama 3's `<|eot_id|>`, Gemma's `<end_of_turn>`, and only for some templates (Mistral's, Llama 2's) the
tokenizer's end-of-text token. Generation that stops only at the tokenizer's eos runs past the turn ("hello
there\\nhello there\\n..."), so the end of turn is read off the template itself, and generation stops at it or at the
eos, as published generation_config.json files list both (Llama 3.1 Instruct's [128001, 128008, 128009]).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer3d.errors import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MARK = "\u2e3bTRAINER3D_END_OF_TURN_PROBE\u2e3b"  # a reply no template rewrites and no vocabulary merges with


def end_of_turn_ids(tok: PreTrainedTokenizerBase, eos_token: str | None = None) -> list[int]:
    """The ids that end a reply: the end-of-turn token first (`eos_token`, a user's override, else the first special or
    added token the chat template writes after an assistant's content, else the tokenizer's eos), then the
    tokenizer's eos where it differs."""
    if eos_token is not None:
        first = _vocab_id(tok, eos_token)
    else:
        first = template_end_of_turn(tok)
        first = tok.eos_token_id if first is None else first
    ids = [first] if first is not None else []
    if tok.eos_token_id is not None and tok.eos_token_id not in ids:
        ids.append(tok.eos_token_id)
    return ids


def template_end_of_turn(tok: PreTrainedTokenizerBase) -> int | None:
    """The first special or added token the chat template writes right after an assistant's content, or None (no
    template, one that fails to render a [user, assistant] exchange, or one that writes no such token)."""
    if not getattr(tok, "chat_template", None):
        return None
    messages = [{"role": "user", "content": "A"}, {"role": "assistant", "content": MARK}]
    try:
        text = tok.apply_chat_template(messages, tokenize=False)
    except Exception:  # noqa: BLE001 - jinja errors, raise_exception() of templates that refuse the exchange
        return None
    if not isinstance(text, str) or MARK not in text:
        return None
    after = text[text.index(MARK) + len(MARK):]
    special = set(getattr(tok, "added_tokens_decoder", {}) or {}) | set(tok.all_special_ids)
    ids = tok(after, add_special_tokens=False)["input_ids"] if after else []
    return next((i for i in ids if i in special), None)


def _vocab_id(tok: PreTrainedTokenizerBase, token: str) -> int:
    vocab = tok.get_vocab()
    if token not in vocab:
        raise DataError(f"--eos-token {token!r} is not one token of the tokenizer's vocabulary; pass a token it "
                        "holds (its end of turn, e.g. <|im_end|>, <|eot_id|> or <end_of_turn>).")
    return int(vocab[token])
