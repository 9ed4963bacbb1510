"""Chat data for the tests, offline: the bundled GPT-2 BPE with a turn-opening token and a ChatML-like template that
closes every turn with the end-of-text token (as Llama 3's closes turns with <|eot_id|>), so an end-of-text inside a
conversation must split nothing; the same template with {% generation %} tags; and conversations in a jsonl file."""

from __future__ import annotations

import json
import random
from pathlib import Path

from trainer3d.data.tokenizer import BUNDLED_TOKENIZER_DIR

TURN = "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|endoftext|>' + '\\n' }}"
TAGGED_TURN = ("{{ '<|im_start|>' + message['role'] + '\\n' }}{%- if message['role'] == 'assistant' %}{% generation %}"
               "{{ message['content'] + '<|endoftext|>' + '\\n' }}{% endgeneration %}{%- else %}"
               "{{ message['content'] + '<|endoftext|>' + '\\n' }}{%- endif %}")


def template(tags: bool = False) -> str:
    return ("{%- for message in messages %}" + (TAGGED_TURN if tags else TURN) + "{%- endfor %}"
            "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")


def chat_tokenizer(directory: Path, tags: bool = False) -> Path:
    """A tokenizer directory with a chat template (and a pad token), written once."""
    from transformers import AutoTokenizer

    if not (directory / "tokenizer_config.json").exists():
        tok = AutoTokenizer.from_pretrained(str(BUNDLED_TOKENIZER_DIR))
        tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"], "pad_token": "<|pad|>"})
        tok.chat_template = template(tags)
        tok.save_pretrained(str(directory))
    return directory


WORDS = ("the king is dead long live the queen what light through yonder window breaks it is the east and juliet "
         "is the sun arise fair sun and kill the envious moon").split()


def conversations(n: int, seed: int = 0, max_turns: int = 3) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        turns = [{"role": "system", "content": "Be brief."}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, max_turns)):
            for role in ("user", "assistant"):
                turns.append({"role": role, "content": " ".join(rng.choices(WORDS, k=rng.randint(2, 12)))})
        out.append(turns)
    return out


def chat_jsonl(path: Path, n: int, seed: int = 0, field: str = "messages") -> Path:
    path.write_text("".join(json.dumps({field: c}) + "\n" for c in conversations(n, seed)))
    return path
