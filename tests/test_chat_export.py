"""An exported chat fine-tune stops at the end of its turn (issue 43, item 5).

A ChatML template closes every turn with <|im_end|>, a token distinct from the tokenizer's eos <|end_of_text|>. Before
trainer3d/data/turn_end.py, the export wrote no generation_config.json and config.json's eos was <|end_of_text|>, so
transformers' `generate` (and `trainer3d.sample --chat`, which stopped at the tokenizer's eos) ran past the reply:
"hello there<|im_end|>\\n..." up to max_new_tokens. These tests guard the ids that end a reply (the template's end of
turn, then the eos; a user's --eos-token; a bad one refused), and the user's path: a random Llama fine-tuned by the
training entry point to answer "hello there", exported, read back by transformers whose greedy `generate`, given no
eos by the caller, stops right after <|im_end|> (the same call with the old eos runs on), and `trainer3d.sample --chat`
printing exactly "hello there".
"""

from __future__ import annotations

import json
import random

import pytest
import transformers

from helpers.chat_data import END, EOS, WORDS, chat_tokenizer, template
from test_llama import hf_llama
from trainer3d.data.turn_end import end_of_turn_ids
from trainer3d.errors import DataError

CHATML = ("{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{%- endif %}")
ANSWER = "hello there"
CONTEXT = 256  # the model's n_positions: the exported tokenizer's model_max_length


def _tokenizer(directory, chat_template=None):
    chat_tokenizer(directory, chat_template=chat_template)
    return transformers.AutoTokenizer.from_pretrained(directory)


def test_end_of_turn_ids(tmp_path):
    """ChatML: [<|im_end|>, eos]; a template closing turns with the eos, or no template: [eos]; an override first;
    a token outside the vocabulary: one sentence naming the fix."""
    tok = _tokenizer(tmp_path / "chatml", CHATML)
    end, eos = tok.convert_tokens_to_ids(END), tok.convert_tokens_to_ids(EOS)
    assert end != eos and tok.eos_token_id == eos
    assert end_of_turn_ids(tok) == [end, eos]
    assert end_of_turn_ids(tok, "<|im_start|>") == [tok.convert_tokens_to_ids("<|im_start|>"), eos]
    assert end_of_turn_ids(tok, EOS) == [eos]
    with pytest.raises(DataError, match=r"^--eos-token '<\|eot_id\|>' is not one token of the tokenizer's vocab"):
        end_of_turn_ids(tok, "<|eot_id|>")
    tok.chat_template = template()  # turns closed by the eos (as Mistral's are)
    assert end_of_turn_ids(tok) == [eos]
    tok.chat_template = None
    assert end_of_turn_ids(tok) == [eos]
    tok.chat_template = "{{ raise_exception('no assistant turns here') }}"
    assert end_of_turn_ids(tok) == [eos]


def test_the_exported_tokenizer_carries_the_runs_template(tmp_path):
    """A run whose --chat-template replaced the tokenizer's: the shipped tokenizer chats with the run's template, ends
    replies at its <|im_end|> (the old eos kept as the list's second, and as the pad token where there was none), and
    knows the model's context."""
    from trainer3d.data.export_tokenizer import export_tokenizer

    _tokenizer(tmp_path / "src")  # our template: turns closed by the eos
    out, tok, stop = export_tokenizer(tmp_path / "src", tmp_path / "out", CONTEXT, chat_template=CHATML)
    shipped = transformers.AutoTokenizer.from_pretrained(out)
    assert out == tmp_path / "out" and shipped.chat_template == CHATML and shipped.eos_token == END
    assert stop == [shipped.convert_tokens_to_ids(END), shipped.convert_tokens_to_ids(EOS)]
    assert shipped.pad_token == "<|pad|>" and shipped.model_max_length == CONTEXT
    unpadded = _tokenizer(tmp_path / "base", CHATML)
    unpadded.pad_token = None
    unpadded.save_pretrained(tmp_path / "unpadded")
    out, tok, _ = export_tokenizer(tmp_path / "unpadded", tmp_path / "padded", CONTEXT)
    assert transformers.AutoTokenizer.from_pretrained(out).pad_token == EOS  # the old eos pads
    # a text run's tokenizer keeps the eos its documents end with; its generation still stops at the end of turn too
    _, tok, stop = export_tokenizer(tmp_path / "base", tmp_path / "text", CONTEXT, chat=False)
    assert tok.eos_token == EOS and stop == [tok.convert_tokens_to_ids(END), tok.eos_token_id]


def _conversations(n: int = 16) -> list[list[dict[str, str]]]:
    rng = random.Random(0)
    return [[{"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 5)))},
             {"role": "assistant", "content": ANSWER}] for _ in range(n)]


def test_a_chat_fine_tune_exports_a_model_that_stops_at_the_end_of_its_turn(tmp_path, monkeypatch, capsys):
    """Guards the user's path (module docstring): before the fix, transformers' `generate` without an eos from the
    caller ran on past <|im_end|> (config.json's eos was <|end_of_text|>, no generation_config.json), and so did
    `trainer3d.sample --chat`. One process, no torchrun; 16 conversations one per row (--no-pack: packed they fill
    fewer rows than a global batch), so every step sees them all."""
    from trainer3d.export import main as export_main
    from trainer3d.sample import main as sample_main
    from trainer3d.train.loop import main as train_main

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    hf_dir, run, out = tmp_path / "hf", tmp_path / "run", tmp_path / "export"
    hf_llama(tie=True, seed=1, max_position_embeddings=CONTEXT,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}).save_pretrained(hf_dir)
    chat_tokenizer(hf_dir, chat_template=CHATML)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in _conversations()))
    assert train_main(["--init-from-hf", str(hf_dir), "--data", str(data), "--data-format", "chat", "--no-pack",
                       "--seq-len", "64", "--global-batch", "16", "--val-fraction", "0", "--eval-every", "0",
                       "--epochs", "30", "--lr", "1e-2", "--min-lr", "1e-2", "--warmup-steps", "0",
                       "--out-dir", str(run)]) == 0  # 30 passes of one step; loss 7.0 -> 0.007 (0.13 at step 20)
    _check_throughput(run, hf_dir)
    assert export_main([str(run), str(out)]) == 0

    tok = transformers.AutoTokenizer.from_pretrained(out)
    end, eos = tok.convert_tokens_to_ids(END), tok.convert_tokens_to_ids(EOS)
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [end, eos] and json.loads((out / "config.json").read_text())[
        "eos_token_id"] == [end, eos]
    assert tok.eos_token == END and tok.pad_token == "<|pad|>" and tok.model_max_length == CONTEXT

    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    prompt = "long live the queen"
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    reply = model.generate(ids, max_new_tokens=20, do_sample=False)[0, ids.shape[1]:].tolist()
    assert reply[-1] == end and tok.decode(reply[:-1]) == ANSWER, tok.decode(reply)
    # what the export gave before: config.json's eos only, which this template never writes: the reply runs on
    old = model.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=eos, pad_token_id=eos)[0, ids.shape[1]:]
    assert old.tolist()[: len(reply)] == reply and len(old) > len(reply) + 1, tok.decode(old)

    for source in (run, out):
        capsys.readouterr()
        assert sample_main([str(source), "--chat", "--prompt", prompt, "--temperature", "0"]) == 0
        assert capsys.readouterr().out.split("\n", 1)[1] == ANSWER + "\n", source
    assert sample_main([str(run), "--chat", "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "20",
                        "--eos-token", EOS]) == 0  # the old stop: past the turn
    assert capsys.readouterr().out.split("\n", 1)[1].startswith(ANSWER + END + "\n")
    _export_choices(run, tmp_path, capsys)


def _check_throughput(run, hf_dir) -> None:
    """--epochs 30 of 16 rows at a global batch of 16 is 30 steps; a step's tokens are the rows' real tokens (not 16 ×
    64 with the padding) and its supervised_tokens the replies' (counted here from transformers' renderings)."""
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    tok.chat_template = CHATML
    whole = [tok.apply_chat_template(c, tokenize=True, return_dict=True)["input_ids"] for c in _conversations()]
    prompts = [tok.apply_chat_template(c[:1], tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
               for c in _conversations()]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 30 and steps[-1]["step"] == 30
    real, replies = sum(min(len(w), 64) for w in whole), sum(len(w) - len(p) for w, p in zip(whole, prompts))
    assert real < 16 * 64 and [r["tokens"] for r in steps] == [real * (i + 1) for i in range(30)]
    assert all(r["supervised_tokens"] == replies for r in steps)


def _export_choices(run, tmp_path, capsys):
    """--eos-token overrides the template's end of turn; one outside the vocabulary is one sentence, exit 2, nothing
    written; a tokenizer without a chat template still gets a generation_config.json, with its eos."""
    from test_llama_hf import bpe_tokenizer
    from trainer3d.export import main as export_main

    assert export_main([str(run), str(tmp_path / "eos"), "--eos-token", EOS]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "eos")
    assert tok.eos_token == EOS and json.loads((tmp_path / "eos" / "generation_config.json").read_text())[
        "eos_token_id"] == tok.eos_token_id
    capsys.readouterr()
    assert export_main([str(run), str(tmp_path / "bad"), "--eos-token", "<|eot_id|>"]) == 2
    assert capsys.readouterr().err == ("trainer3d: error: --eos-token '<|eot_id|>' is not one token of the "
                                       "tokenizer's vocabulary; pass a token it holds (its end of turn, e.g. "
                                       "<|im_end|>, <|eot_id|> or <end_of_turn>).\n")
    assert not (tmp_path / "bad").exists()
    bpe_tokenizer(tmp_path / "text_tok")  # no chat template
    assert export_main([str(run), str(tmp_path / "text"), "--tokenizer", str(tmp_path / "text_tok")]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "text")
    generation = json.loads((tmp_path / "text" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tok.eos_token_id == tok.convert_tokens_to_ids(EOS)
    assert tok.model_max_length == CONTEXT
