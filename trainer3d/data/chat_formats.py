"""The shapes chat data comes in, each turned into one `Conversation` (data/chat.py):

- OpenAI-style messages: ``{role, content}`` where content is text, null (an assistant turn that only calls tools)
  or a list of parts (``[{"type": "text", "text": ...}]``, joined); ``tool_calls`` and other keys kept; a ``tools``
  column (a list, or its JSON text) is passed to the template.
- ShareGPT: ``{from, value}`` turns (``--data-format sharegpt``, or recognised in the messages column), roles mapped
  as FastChat and Axolotl map them (human → user, gpt → assistant, observation → tool, ...).
- prompt/completion columns (TRL's): lists of messages are one conversation, only the completion's turns supervised; plain
  texts are not chat at all: prompt + completion + eos, tokenized as TRL does, the completion and eos supervised.

Arrow gives every struct of a column the union of the keys seen in it, filled with nulls: those nulls are dropped
again here, so that a template sees the message as it was written.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from trainer3d.data.chat import BadRow, Conversation, overlap_flags
from trainer3d.errors import DataError

FORMATS = ("chat", "sharegpt")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
                  "system": "system", "tool": "tool", "observation": "tool", "function_response": "tool",
                  "function_call": "assistant"}


def columns_of(column_names: list[str], fmt: str, field: str, name: str) -> tuple[str, list[str]]:
    """(the kind of rows, the columns to read): "messages" (OpenAI or ShareGPT turns in `field`) or "pair"
    (prompt/completion), or one sentence naming the columns there are."""
    if fmt == "sharegpt" and field == "messages" and "messages" not in column_names:
        field = "conversations"  # ShareGPT's own column name
    if field in column_names:
        return "messages", [field] + (["tools"] if "tools" in column_names else [])
    if {"prompt", "completion"} <= set(column_names):
        return "pair", ["prompt", "completion"] + (["tools"] if "tools" in column_names else [])
    raise DataError(f"The chat data {name} has no column '{field}' and no prompt/completion columns; set "
                    f"--messages-field to the column of turns, one of: {', '.join(column_names)}.")


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def _tools(value: Any) -> list[dict] | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise BadRow("its 'tools' column is neither a list nor its JSON text") from None
    return _drop_nulls(list(value)) or None


def _message(m: Any, sharegpt: bool) -> dict[str, Any]:
    if not isinstance(m, dict):
        raise BadRow(f"it has a message that is not an object ({str(m)[:80]})")
    m = _drop_nulls(m)
    if sharegpt or ("role" not in m and "from" in m):
        if not isinstance(m.get("from"), str) or "value" not in m:
            raise BadRow(f"it has a ShareGPT turn without 'from' and 'value' ({str(m)[:80]})")
        extra = {k: v for k, v in m.items() if k not in ("from", "value")}
        m = {"role": SHAREGPT_ROLES.get(m["from"].lower(), m["from"]), "content": m["value"], **extra}
    if not isinstance(m.get("role"), str):
        raise BadRow(f"it has a message without a role ({str(m)[:80]})")
    content = m.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):
        kinds = {p.get("type") for p in content if isinstance(p, dict)}
        if kinds - {"text"} or not all(isinstance(p, dict) for p in content):
            raise BadRow(f"it has content parts other than text ({', '.join(sorted(map(str, kinds - {'text'})))}), "
                         "which a text model cannot read")
        content = "".join(p.get("text", "") for p in content)
    elif not isinstance(content, str):
        raise BadRow(f"it has a message whose content is not text ({type(content).__name__})")
    return {**m, "content": content}


def conversation(row: dict[str, Any], kind: str, columns: list[str], sharegpt: bool) -> Conversation | tuple[str, str]:
    """A row as a Conversation, or (prompt, completion) texts; raises BadRow."""
    tools = _tools(row.get("tools"))
    if kind == "pair":
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            return prompt, completion
        if not isinstance(prompt, list) or not isinstance(completion, list) or not completion:
            raise BadRow("its prompt and completion are neither both texts nor both lists of messages")
        return Conversation([_message(m, False) for m in prompt + completion], tools, completion_from=len(prompt))
    messages = row[columns[0]]
    if isinstance(messages, str) or not isinstance(messages, list) or not messages:
        raise BadRow(f"it has no list of messages in '{columns[0]}'")
    return Conversation([_message(m, sharegpt) for m in messages], tools)


def encode_pair(tok, prompt: str, completion: str) -> tuple[np.ndarray, np.ndarray]:
    """Plain prompt/completion texts as TRL tokenizes them: prompt + completion with the tokenizer's own special tokens
    (a BOS where it adds one) and eos appended; the completion's tokens (overlap rule) and the eos supervised."""
    text = prompt + completion
    enc = tok(text, return_offsets_mapping=True, return_attention_mask=False)
    ids = list(enc["input_ids"]) + [tok.eos_token_id]
    flags = overlap_flags(list(enc["offset_mapping"]) + [(len(text), len(text) + 1)], [(len(prompt), len(text) + 1)])
    special = set(tok.all_special_ids) - {tok.eos_token_id}
    flags[[k for k, i in enumerate(ids[:-1]) if i in special]] = 0  # a BOS' offsets are (0, 0); an added EOS too
    return np.asarray(ids, dtype=np.int64), flags
