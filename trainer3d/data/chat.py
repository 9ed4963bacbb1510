"""A conversation as the model sees it: rendered by the tokenizer's own chat template, tokenized without anything
added, and the loss mask of its targets.

The mask rule: a target token is supervised iff its first character lies in an assistant turn's span, and the span of
turn i is what ``render(messages[:i + 1])`` adds to ``render(messages[:i], add_generation_prompt=True)``. Rendering
prefixes works for every template, with or without ``{% generation %}`` tags (most published ones, Llama 3's,
Qwen2.5's, Mistral's, have none, and transformers' ``return_assistant_tokens_mask`` is then empty: Megatron-Bridge
#3359 trained on all-ones masks that way). Where a template has the tags, its mask is used and must agree with the
rule's. A conversation whose spans cannot be derived (a template that renders a prefix differently from the whole) is
refused with one sentence naming the row, never trained on with a guessed mask.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from trainer3d.errors import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TRAIN_ON = ("assistant", "all")
ROLES = ("system", "user", "assistant", "tool", "developer")


def check_chat_tokenizer(tok: PreTrainedTokenizerBase, name: str) -> None:
    if not getattr(tok, "chat_template", None):
        raise DataError(f"The tokenizer {name} has no chat template; pass --tokenizer (or --init-from-hf) a directory "
                        "whose tokenizer_config.json or chat_template.jinja holds one.")
    if not getattr(tok, "is_fast", False):
        raise DataError(f"The tokenizer {name} is not a fast tokenizer, which the loss masks need (character "
                        "offsets); pass a directory with a tokenizer.json.")


_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


def has_generation_tags(tok: PreTrainedTokenizerBase) -> bool:
    return bool(_GENERATION_TAG.search(tok.chat_template or ""))


def check_messages(messages: Any, row: int, field: str) -> list[dict[str, str]]:
    """The row's conversation as a list of {role, content} with text content, or one sentence naming the row."""
    where = f"Row {row} of the chat data"
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise DataError(f"{where} has no list of messages in '{field}'; set --messages-field to the column that holds "
                        "[{role, content}, ...].")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where} has a message that is not {{role: text, content: text}} ({str(m)[:80]}); fix "
                            "the row.")
        out.append({k: v for k, v in m.items() if v is not None})
    return out


def render(tok: PreTrainedTokenizerBase, messages: list[dict[str, str]], generation_prompt: bool = False) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def assistant_spans(tok: PreTrainedTokenizerBase, messages: list[dict[str, str]], row: int) -> tuple[str, list]:
    """(the whole rendering, [(start, end)] character spans of the assistant turns), by rendering prefixes."""
    text = render(tok, messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, upto = _render_prefix(tok, messages[:i]), render(tok, messages[: i + 1])
        if not (upto.startswith(before) and text.startswith(upto)) or len(upto) == len(before):
            raise DataError(
                f"Row {row} of the chat data: the chat template renders the conversation up to its turn {i} differently "
                "from the start of the whole conversation, so that turn's tokens cannot be told apart; fix the row or "
                "use a template that renders prefixes consistently (or --train-on all)."
            )
        spans.append((len(before), len(upto)))
    return text, spans


def _render_prefix(tok, messages: list[dict[str, str]]) -> str:
    """What comes before an assistant turn: the earlier turns and the generation prompt (a template that cannot
    render an empty conversation gives nothing before a first turn)."""
    try:
        return render(tok, messages, generation_prompt=True)
    except Exception:  # noqa: BLE001 - jinja errors of templates that index messages[0]
        if messages:
            raise
        return ""


def encode(tok: PreTrainedTokenizerBase, messages: list[dict[str, str]], row: int, train_on: str
           ) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, flags): flags[k] = 1 where token k is a supervised target (its first character lies in an
    assistant span; every token with --train-on all). Nothing is added beyond what the template writes."""
    text, spans = assistant_spans(tok, messages, row)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True, return_attention_mask=False)
    ids = np.asarray(enc["input_ids"], dtype=np.int64)
    if train_on == "all":
        return ids, np.ones(len(ids), dtype=np.uint8)
    starts = np.asarray([s for s, _ in enc["offset_mapping"]], dtype=np.int64)
    flags = np.zeros(len(ids), dtype=np.uint8)
    for a, b in spans:
        flags[(starts >= a) & (starts < b)] = 1
    if has_generation_tags(tok):
        _check_against_tags(tok, messages, ids, flags, row)
    return ids, flags


def _check_against_tags(tok, messages, ids: np.ndarray, flags: np.ndarray, row: int) -> None:
    """The template's own {% generation %} mask must give the rule's."""
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    tagged = np.asarray(out["assistant_masks"], dtype=np.uint8)
    if len(tagged) != len(ids) or not np.array_equal(np.asarray(out["input_ids"]), ids):
        raise DataError(f"Row {row} of the chat data: the template tokenizes differently with its generation tags; "
                        "fix the template.")
    if not np.array_equal(tagged, flags):
        k = int(np.flatnonzero(tagged != flags)[0])
        raise DataError(f"Row {row} of the chat data: the template's {{% generation %}} mask and the assistant spans "
                        f"disagree at token {k} ({tok.decode(ids[k:k + 1])!r}); fix the template's tags.")
