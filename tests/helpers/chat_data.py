"""Chat data for the tests, offline: a small byte-level BPE (trained here, about 400 tokens) with a turn-opening token
and a ChatML-like template that closes every turn with the end-of-text token (as Llama 3's closes turns with
<|eot_id|>), so an end-of-text inside a conversation must split nothing; the same template with {% generation %}
tags; and conversations in a jsonl file."""

from __future__ import annotations

import json
import random
from pathlib import Path

EOS, START, PAD, END = "<|end_of_text|>", "<|im_start|>", "<|pad|>", "<|im_end|>"
TURN = "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|end_of_text|>' + '\\n' }}"
TAGGED_TURN = ("{{ '<|im_start|>' + message['role'] + '\\n' }}{%- if message['role'] == 'assistant' %}{% generation %}"
               "{{ message['content'] + '<|end_of_text|>' + '\\n' }}{% endgeneration %}{%- else %}"
               "{{ message['content'] + '<|end_of_text|>' + '\\n' }}{%- endif %}")


def template(tags: bool = False) -> str:
    return ("{%- for message in messages %}" + (TAGGED_TURN if tags else TURN) + "{%- endfor %}"
            "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")


def chat_tokenizer(directory: Path, tags: bool = False, chat_template: str | None = None,
                   specials: tuple[str, ...] = ()) -> int:
    """Write a fast tokenizer with a chat template (`chat_template`, else ours with or without tags) and a pad token
    into `directory`; <|im_end|> is a special token too (ChatML's end of turn, for published templates), and so is
    each of `specials` (another template's markers); returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [" ".join(WORDS), "system user assistant tool Be brief. <think> </think> <tool_call> </tool_call> "
            '{"name": "arguments": } \n\n'] * 20
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=400, special_tokens=[EOS, START, PAD, END],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD,
                                   additional_special_tokens=[START, END, *specials])
    fast.chat_template = chat_template or template(tags)
    fast.save_pretrained(str(directory))
    return len(fast)


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
