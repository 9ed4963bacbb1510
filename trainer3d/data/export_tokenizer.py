"""The tokenizer an export ships, and the special ids its config files name: family-neutral (every family ships a
transformers tokenizer), so it lives beside the tokenizers and chat templates rather than in an export of weights.

What it makes true of an export (trainer3d/export.py): generate stops where a reply ends (config.json and
generation_config.json list the end of turn of data/turn_end.py, then the eos), a chat run's tokenizer has that end
of turn as its eos_token (as TRL saves chat fine-tunes; the old eos becomes the pad where there was none), its chat
template is the run's --chat-template, and its model_max_length is the model's context, not transformers' "unset"
sentinel.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from trainer3d.data.tokenizer import BUNDLED_TOKENIZER_DIR, load_tokenizer
from trainer3d.data.turn_end import end_of_turn_ids
from trainer3d.errors import DataError

UNSET_MAX_LENGTH = 1e29  # transformers' model_max_length when a tokenizer names none is VERY_LARGE_INTEGER, 1e30


def tokenizer_dir(name: str | None, scratch: Path, trust_remote_code: bool = False) -> tuple[Path | None, str | None]:
    """(directory to copy, warning) for the tokenizer a run used: None -> the bundled GPT-2 BPE, a tokenizer folder as
    is; a model directory (--init-from-hf's, which holds the tokenizer beside config.json and the weights) or a Hugging
    Face name: the tokenizer alone, saved from it."""
    if name is None or (name in ("gpt2", "openai-community/gpt2") and not os.path.exists(name)):
        return BUNDLED_TOKENIZER_DIR, None
    if name.lower() == "none":
        return None, None
    if os.path.isdir(name) and not (Path(name) / "config.json").exists():
        return Path(name), None
    try:
        load_tokenizer(name, trust_remote_code).save_pretrained(str(scratch))
    except (DataError, OSError) as e:
        return None, f"tokenizer {name!r} not exported ({e}); copy its files into the output yourself"
    return scratch, None


def export_tokenizer(src: Path, scratch: Path, n_positions: int, eos_token: str | None = None,
                     chat_template: str | None = None, chat: bool = True,
                     trust_remote_code: bool = False) -> tuple[Path, object, list[int]] | None:
    """(the tokenizer directory to ship, the tokenizer as shipped, the ids that end a reply): the tokenizer under
    `src` with the run's `chat_template` text, the model's context as model_max_length and, for a `chat` run, its end
    of turn as eos_token (the old eos as pad where it had none; a text run keeps its eos, which its documents end
    with), written to `scratch` only where one of them changed. None where transformers cannot load `src` (its
    files are then shipped as they are)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(src), trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - what load_tokenizer refuses; the export ships the files as they are
        return None
    changed = chat_template is not None and chat_template != tok.chat_template
    if changed:
        tok.chat_template = chat_template
    stop = end_of_turn_ids(tok, eos_token)
    end = tok.convert_ids_to_tokens(stop[0]) if stop else tok.eos_token
    if chat and end != tok.eos_token:
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        tok.eos_token, changed = end, True
    if tok.model_max_length > UNSET_MAX_LENGTH or tok.model_max_length > n_positions:
        tok.model_max_length, changed = n_positions, True
    if not changed:
        return src, tok, stop
    shutil.copytree(src, scratch, dirs_exist_ok=True)  # files save_pretrained does not write (a README) go too
    tok.save_pretrained(str(scratch))
    return scratch, tok, stop


def special_ids(tok, stop: list[int], vocab_size: int) -> tuple[dict, dict]:
    """(config.json's eos/bos ids, generation_config.json's eos/bos/pad ids), where the model's vocabulary has them:
    the ids that end a reply, one as an int, several as a list (as published files spell them)."""
    stop = [i for i in stop if i < vocab_size]
    ids = {"eos_token_id": (stop[0] if len(stop) == 1 else stop) if stop else None, "bos_token_id": tok.bos_token_id}
    ids = {k: v for k, v in ids.items() if v is not None and (isinstance(v, list) or v < vocab_size)}
    generation = dict(ids)
    if tok.pad_token_id is not None and tok.pad_token_id < vocab_size:
        generation["pad_token_id"] = tok.pad_token_id
    return ids, generation
