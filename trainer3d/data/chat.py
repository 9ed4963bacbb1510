"""A conversation as the model sees it: rendered by the chat template, tokenized with nothing added, and the loss mask
of its targets.

Which tokens are supervised (`MaskRule`):
- ``train_on="all"``: every token; no turn needs to be told apart.
- A template with ``{% generation %}`` tags (TRL's ``*_training.jinja``): exactly the tagged tokens, as transformers'
  ``return_assistant_tokens_mask`` gives them and TRL's ``assistant_only_loss`` trains them (a token counts if it
  overlaps the tagged text). The tags are the template author's word: where they differ from the prefix rule below
  they win (Qwen2.5's training template tags the "\\n" after "assistant", which the generation prompt holds; tags that
  close at ``<|im_end|>`` leave the "\\n" after it out).
- Otherwise the prefix rule: turn i's span is what ``render(messages[:i + 1])`` adds to ``render(messages[:i])``
  (with the generation prompt before an assistant turn), and a token is supervised if it overlaps a span of a
  trained role (transformers' convention for a token that straddles a boundary). Most published templates have no
  tags (Llama 3's, Qwen2.5's, Mistral's; Megatron-Bridge #3359 trained on all-ones masks there).
A row whose mask cannot be derived (a template that renders a prefix differently from the whole, as the stock Qwen3
template does when it strips earlier turns' reasoning), whose template raises, or which has an unknown role is a
`BadRow`: data/sft.py drops and counts it, or stops the run (--on-bad-row), never trains on a guessed mask.
"""

from __future__ import annotations

import re
from pathlib import Path
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from trainer3d.errors import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TRAIN_ON = ("assistant", "last", "all")
ROLES = ("system", "user", "assistant", "tool", "developer", "ipython", "function")


class BadRow(DataError):
    """A row that cannot be trained on as it is (the reason, without the row's number: the caller names it)."""


@dataclass(frozen=True)
class MaskRule:
    train_on: str = "assistant"  # the turns of `roles`, only the last of them, or "all" tokens
    roles: tuple[str, ...] = ("assistant",)
    template_kwargs: dict = field(default_factory=dict)  # --chat-template-kwargs, passed to every rendering


@dataclass
class Conversation:
    messages: list[dict[str, Any]]
    tools: list[dict] | None = None  # the row's tool schemas, passed to the template
    completion_from: int = 0  # a prompt/completion row: the completion's first turn; earlier turns are never trained


def check_chat_tokenizer(tok: PreTrainedTokenizerBase, name: str) -> None:
    if not getattr(tok, "chat_template", None):
        raise DataError(f"The tokenizer {name} has no chat template; pass --chat-template FILE, or --tokenizer (or "
                        "--init-from-hf) a directory whose tokenizer_config.json or chat_template.jinja holds one.")
    if not getattr(tok, "is_fast", False):
        raise DataError(f"The tokenizer {name} is not a fast tokenizer, which the loss masks need (character "
                        "offsets); pass a directory with a tokenizer.json.")


def read_template(path: str) -> str:
    """The text of a --chat-template file (a run's template replaces the tokenizer's in training, sample and export)."""
    try:
        return Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"--chat-template {path} cannot be read ({type(e).__name__}: {e}); pass a readable jinja "
                        "file.") from None


_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


def has_generation_tags(tok: PreTrainedTokenizerBase) -> bool:
    return bool(_GENERATION_TAG.search(tok.chat_template or ""))


def render(tok: PreTrainedTokenizerBase, conv: Conversation | list[dict], generation_prompt: bool = False,
           upto: int | None = None, kwargs: dict | None = None) -> str:
    """The template's text for the messages[:upto] of `conv` (a Conversation or a list of messages); a template's own
    error becomes a BadRow (no jinja traceback)."""
    if not isinstance(conv, Conversation):
        conv = Conversation(list(conv))
    messages = conv.messages if upto is None else conv.messages[:upto]
    try:
        return tok.apply_chat_template(messages, tools=conv.tools, tokenize=False,
                                       add_generation_prompt=generation_prompt, **(kwargs or {}))
    except Exception as e:  # noqa: BLE001 - jinja's raise_exception (roles must alternate, ...), undefined fields
        raise BadRow(f"the chat template fails on it ({type(e).__name__}: {str(e).splitlines()[0][:160]})") from None


def encode(tok: PreTrainedTokenizerBase, conv: Conversation, rule: MaskRule) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, flags): flags[k] = 1 where token k is a supervised target. Nothing is added beyond what the template
    writes. Raises BadRow."""
    unknown = sorted({m["role"] for m in conv.messages} - set(ROLES))
    if unknown:
        raise BadRow(f"it has a message of role {unknown[0]!r}, which no chat template knows (roles: "
                     f"{', '.join(ROLES)})")
    if rule.train_on == "all":
        ids = _tokenize(tok, render(tok, conv, kwargs=rule.template_kwargs))["input_ids"]
        return np.asarray(ids, dtype=np.int64), np.ones(len(ids), dtype=np.uint8)
    if has_generation_tags(tok) and rule.roles == ("assistant",):
        return _tagged(tok, conv, rule)
    text, spans = turn_spans(tok, conv, rule)
    enc = _tokenize(tok, text, offsets=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int64)
    return ids, overlap_flags(enc["offset_mapping"], spans)


def _tokenize(tok, text: str, offsets: bool = False):
    return tok(text, add_special_tokens=False, return_offsets_mapping=offsets, return_attention_mask=False)


def overlap_flags(offsets, spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for each token whose characters overlap one of `spans` (transformers' rule for assistant masks)."""
    flags = np.zeros(len(offsets), dtype=np.uint8)
    if spans:
        starts = np.asarray([s for s, _ in offsets], dtype=np.int64)
        ends = np.asarray([e for _, e in offsets], dtype=np.int64)
        for a, b in spans:
            flags[(starts < b) & (ends > a)] = 1
    return flags


def _tagged(tok, conv: Conversation, rule: MaskRule) -> tuple[np.ndarray, np.ndarray]:
    """The template's {% generation %} mask (all tagged blocks, or the last one for --train-on last)."""
    try:
        out = tok.apply_chat_template(conv.messages, tools=conv.tools, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True, **rule.template_kwargs)
    except Exception as e:  # noqa: BLE001 - as in render
        raise BadRow(f"the chat template fails on it ({type(e).__name__}: {str(e).splitlines()[0][:160]})") from None
    ids = np.asarray(out["input_ids"], dtype=np.int64)
    flags = np.asarray(out["assistant_masks"], dtype=np.uint8)
    if conv.completion_from:  # the prompt's tagged replies are not the completion
        prompt = len(render(tok, conv, True, upto=conv.completion_from, kwargs=rule.template_kwargs))
        starts = [s for s, _ in _tokenize(tok, render(tok, conv, kwargs=rule.template_kwargs), True)["offset_mapping"]]
        flags[: int(np.searchsorted(starts, prompt))] = 0
    if rule.train_on == "last" and flags.any():
        edges = np.flatnonzero(np.diff(np.concatenate([[0], flags])) == 1)  # where each tagged block starts
        flags[: edges[-1]] = 0
    return ids, flags


def turn_spans(tok, conv: Conversation, rule: MaskRule) -> tuple[str, list[tuple[int, int]]]:
    """(the whole rendering, character spans of the trained turns) by the prefix rule; BadRow where a prefix does not
    render as the start of the whole."""
    kw = rule.template_kwargs
    text = render(tok, conv, kwargs=kw)
    turns = [i for i, m in enumerate(conv.messages) if m["role"] in rule.roles and i >= conv.completion_from]
    if rule.train_on == "last":
        turns = turns[-1:]
    spans = []
    for i in turns:
        before = _render_before(tok, conv, i, kw)
        upto = render(tok, conv, upto=i + 1, kwargs=kw)
        if not (upto.startswith(before) and text.startswith(upto)) or len(upto) == len(before):
            raise BadRow(f"the chat template renders the conversation up to its turn {i} differently from the start "
                         "of the whole, so that turn's tokens cannot be told apart (the stock Qwen3 template strips "
                         "earlier turns' reasoning): use a template with {% generation %} tags (--chat-template, e.g. "
                         "TRL's *_training.jinja) or --train-on last")
        spans.append((len(before), len(upto)))
    return text, spans


def _render_before(tok, conv: Conversation, i: int, kwargs: dict) -> str:
    """What comes before turn i: the earlier turns, and the generation prompt before an assistant's (a template that
    cannot render an empty conversation gives nothing before a first turn)."""
    try:
        return render(tok, conv, conv.messages[i]["role"] == "assistant", upto=i, kwargs=kwargs)
    except BadRow:
        if i:
            raise
        return ""
