"""A reference for DPO: TRL 1.16's DPOTrainer run step by step on a tiny random Llama with a chat tokenizer, fp32 on
CPU, the whole set of pairs as one batch a step, constant lr, AdamW with TRL's defaults; per step the loss, the
gradient norm (before clipping) and the reward metrics as TRL logs them. Also TRL's own tokenization of the rows
(`trl_dpo_tokenized`) and the DPO loss and metrics written out by hand from those tokens (`dpo_by_hand`), which
check each other. Not a test module: tests import it (`python tests/helpers/trl_dpo_reference.py` runs a small check).

What TRL 1.16 does (trl/trainer/dpo_trainer.py):
- tokens: a conversational prompt is the chat template with add_generation_prompt=True, prompt + chosen (and prompt +
  rejected) the template without it; the completion is what follows the longest common prefix of the prompt's and
  both full renderings. Plain text: tokenizer(prompt) and tokenizer(prompt + chosen + eos) (eos appended unless the
  text ends with it; special tokens such as a BOS as the tokenizer adds them), the completion again what follows the
  common prefix. Truncation (max_length, keep_start): prompt + completion cut to its first max_length tokens; a pair
  whose prompt alone has max_length tokens or more is dropped.
- log-probabilities summed over each completion's tokens (no length normalization), chosen rows then rejected rows in
  one right-padded forward; the reference model (a fresh load of the policy's directory) scores the same batch.
- sigmoid: -logsigmoid(beta * ((pc - rc) - (pr - rr))), no label smoothing (only robust/exo_pair/aot read it);
  ipo: ((pc - rc) / |c| - (pr - rr) / |r| - 1 / (2 beta))^2, |c| and |r| the completion lengths; the mean over pairs.
- rewards/chosen = mean beta (pc - rc), rewards/rejected likewise, rewards/margins their difference's mean,
  rewards/accuracies the fraction of pairs with chosen reward > rejected reward (strictly); logps/* the means of pc, pr.
"""

from __future__ import annotations

import math
import os
import random
import sys
import time
from pathlib import Path

import torch

for _path in Path(__file__).resolve().parents[1:3]:  # tests (helpers, test_llama), trainer3d (which test_llama imports)
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from helpers.chat_data import WORDS, chat_tokenizer

METRICS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
           "logps/chosen", "logps/rejected")


def tiny_chat_model(directory: str | Path, seed: int = 5, tie: bool = False) -> int:
    """Save into `directory` chat_data's byte-level BPE tokenizer (eos <|end_of_text|>, pad <|pad|>, <|im_start|>
    and <|im_end|> special; a ChatML-like template that closes each turn with eos + "\\n") and a random
    LlamaForCausalLM of test_llama.hf_llama (hidden 64, 2 layers, 4 heads on 2 kv heads) with the tokenizer's
    vocabulary; returns the vocabulary size."""
    from test_llama import hf_llama

    directory = Path(directory)
    vocab = chat_tokenizer(directory)
    hf_llama(tie=tie, seed=seed, vocab_size=vocab).save_pretrained(directory)
    return vocab


def _words(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choices(WORDS, k=rng.randint(lo, hi)))


def preference_rows(n: int = 16, conversational: bool = False, seed: int = 0) -> list[dict]:
    """n deterministic pairs of short words from chat_data.WORDS, chosen != rejected. Conversational: a user turn
    (a system turn first in some) and one assistant turn on each side; plain text: the completions start with a
    space, so no token straddles the prompt's end."""
    rng, rows = random.Random(seed), []
    while len(rows) < n:
        prompt, chosen, rejected = _words(rng, 2, 8), _words(rng, 1, 7), _words(rng, 1, 7)
        if chosen == rejected:
            continue
        if conversational:
            system = [{"role": "system", "content": "Be brief."}] if rng.random() < 0.3 else []
            rows.append({"prompt": system + [{"role": "user", "content": prompt}],
                         "chosen": [{"role": "assistant", "content": chosen}],
                         "rejected": [{"role": "assistant", "content": rejected}]})
        else:
            rows.append({"prompt": prompt, "chosen": " " + chosen, "rejected": " " + rejected})
    return rows


def _config(out_dir, n: int, steps: int, lr: float, beta: float, loss_type: str, label_smoothing: float,
            max_length: int | None, max_grad_norm: float, seed: int, **overrides):
    import trl

    kw = dict(
        output_dir=str(out_dir), per_device_train_batch_size=n, gradient_accumulation_steps=1, max_steps=steps,
        learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9,
        adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=max_grad_norm, beta=beta, loss_type=loss_type.split(","),
        label_smoothing=label_smoothing, max_length=max_length, truncation_mode="keep_start", padding_free=False,
        precompute_ref_log_probs=False, bf16=False, fp16=False, use_cpu=True, activation_checkpointing=False,
        disable_dropout=True, logging_steps=1, report_to="none", save_strategy="no", eval_strategy="no",
        dataloader_num_workers=0, dataset_num_proc=None, seed=seed, disable_tqdm=True)
    kw.update(overrides)
    return trl.DPOConfig(**kw)


def _trainer(model_dir, rows, args, ref_model_dir=None, eval_rows=None, adapter_dir=None):
    import datasets
    import transformers
    import trl

    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")  # _BaseTrainer pings the Hub otherwise
    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(ref_model_dir)) if ref_model_dir else None
    model = str(model_dir)
    if adapter_dir:  # a PEFT model: TRL's reference is its base with the adapter disabled
        import peft

        model = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(model), adapter_dir,
                                               is_trainable=True)
    trainer = trl.DPOTrainer(model=model, ref_model=ref, args=args,
                             train_dataset=datasets.Dataset.from_list(rows), processing_class=tok,
                             eval_dataset=datasets.Dataset.from_list(eval_rows) if eval_rows else None)
    trainer.remove_callback(transformers.PrinterCallback)
    return trainer


def trl_dpo_run(model_dir: str, rows: list[dict], steps: int, lr: float, beta: float, loss_type: str = "sigmoid",
                label_smoothing: float = 0.0, max_length: int | None = None, *, out_dir: str,
                max_grad_norm: float = 1.0, seed: int = 0, keep: dict | None = None, ref_model_dir: str | None = None,
                eval_rows: list[dict] | None = None, adapter_dir: str | None = None, **overrides) -> list[dict]:
    """Train the Hugging Face model in `model_dir` (its tokenizer there too) with trl.DPOTrainer on `rows`, all of
    them in each step's one batch, for `steps` steps; per step, TRL's log entry (loss, grad_norm before clipping,
    learning_rate, rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies, logps/chosen,
    logps/rejected, logits/chosen, logits/rejected, entropy, mean_token_accuracy, num_tokens, epoch, step).
    max_length None: no truncation (TRL's default is 1024). label_smoothing: TRL 1.16's sigmoid and ipo losses
    ignore it. `overrides`: further DPOConfig fields (optim, ...). `keep`: if given, filled with "trainer" (after
    training), "policy_before" ({step: state_dict of the policy the step's forward saw}) and, with `eval_rows`, the
    trained model's "evaluation" on them (DPOTrainer.evaluate, all of them in one batch: eval_loss, eval_rewards/*,
    eval_logps/*, eval_logits/*)."""
    import transformers

    if eval_rows:
        overrides.setdefault("per_device_eval_batch_size", len(eval_rows))
    args = _config(out_dir, len(rows), steps, lr, beta, loss_type, label_smoothing, max_length, max_grad_norm,
                   seed, **overrides)
    trainer = _trainer(model_dir, rows, args, ref_model_dir, eval_rows, adapter_dir)
    if keep is not None:
        before = keep.setdefault("policy_before", {})

        class Snapshot(transformers.TrainerCallback):
            def on_step_begin(self, args, state, control, model=None, **kw):
                before[state.global_step + 1] = {k: v.detach().clone() for k, v in model.state_dict().items()}

        trainer.add_callback(Snapshot())
    trainer.train()
    if keep is not None:
        keep["trainer"] = trainer
        if eval_rows:
            keep["evaluation"] = trainer.evaluate()
    log = [h for h in trainer.state.log_history if "loss" in h and "rewards/chosen" in h]
    assert len(log) == steps, trainer.state.log_history
    return log


def trl_dpo_tokenized(model_dir: str, rows: list[dict], max_length: int | None = None, *, out_dir: str,
                      **overrides) -> dict:
    """TRL's tokenization of `rows` (its DPOTrainer's prepared dataset and its collated batch of all of them):
    {"prompt_ids", "chosen_ids", "rejected_ids": one list per kept row; "batch": the collated tensors, input_ids
    of chosen rows then rejected rows, right-padded with the pad id, attention_mask, completion_mask (before
    truncation to max_length in prompt_ids/..._ids, after it in batch)}."""
    args = _config(out_dir, len(rows), 1, 1e-6, 0.1, "sigmoid", 0.0, max_length, 1.0, 0, **overrides)
    trainer = _trainer(model_dir, rows, args)
    data = trainer.train_dataset
    examples = [data[i] for i in range(len(data))]
    return {"prompt_ids": [e["prompt_ids"] for e in examples], "chosen_ids": [e["chosen_ids"] for e in examples],
            "rejected_ids": [e["rejected_ids"] for e in examples], "batch": trainer.data_collator(examples)}


def completion_logps(model, batch: dict, dtype=torch.float64) -> torch.Tensor:
    """Per row of `batch`, the sum of log p(token | before) over its completion tokens (completion_mask), from the
    model's plain logits in `dtype`."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.to(dtype)
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    return (logp * batch["completion_mask"][:, 1:]).sum(1)


def dpo_by_hand(policy, reference, batch: dict, beta: float, loss_type: str = "sigmoid") -> dict:
    """TRL 1.16's DPO loss and reward metrics written out (dpo_trainer.py _compute_loss), float64."""
    pc, pr = completion_logps(policy, batch).chunk(2)
    rc, rr = completion_logps(reference, batch).chunk(2)
    chosen, rejected = pc - rc, pr - rr
    if loss_type == "sigmoid":
        losses = -torch.nn.functional.logsigmoid(beta * (chosen - rejected))
    elif loss_type == "ipo":
        nc, nr = batch["completion_mask"].sum(1).to(torch.float64).clamp(min=1.0).chunk(2)
        losses = (chosen / nc - rejected / nr - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(loss_type)
    rc_, rr_ = beta * chosen, beta * rejected
    return {"loss": losses.mean().item(), "rewards/chosen": rc_.mean().item(), "rewards/rejected": rr_.mean().item(),
            "rewards/margins": (rc_ - rr_).mean().item(), "rewards/accuracies": (rc_ > rr_).double().mean().item(),
            "logps/chosen": pc.mean().item(), "logps/rejected": pr.mean().item()}


def _check(tmp: Path, conversational: bool, loss_type: str, steps: int = 3, beta: float = 0.1, lr: float = 1e-3):
    import transformers

    transformers.utils.logging.disable_progress_bar()
    model_dir = tmp / "hf"
    if not (model_dir / "config.json").exists():
        tiny_chat_model(model_dir)
    rows = preference_rows(16, conversational)
    start = time.perf_counter()
    keep: dict = {}
    log = trl_dpo_run(str(model_dir), rows, steps, lr, beta, loss_type, out_dir=str(tmp / "out"), keep=keep)
    seconds = time.perf_counter() - start
    label = f"{'conversational' if conversational else 'plain text'} {loss_type}"
    print(f"\n{label}: {steps} steps on {len(rows)} pairs in {seconds:.1f} s")
    for k, h in enumerate(log, 1):
        print(f"  step {k}: " + " ".join(f"{m} {h[m]:.8g}" for m in METRICS))
    tokens = trl_dpo_tokenized(str(model_dir), rows, out_dir=str(tmp / "tok"))
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    print(f"  row 0 prompt   {tok.decode(tokens['prompt_ids'][0])!r}")
    print(f"  row 0 chosen   {tok.decode(tokens['chosen_ids'][0])!r}")
    print(f"  row 0 rejected {tok.decode(tokens['rejected_ids'][0])!r}")
    # each logged step against the same formulas by hand, from the policy that step's forward saw, in float64
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    policy = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    worst = 0.0
    for k, h in enumerate(log, 1):
        policy.load_state_dict(keep["policy_before"][k])
        hand = dpo_by_hand(policy, reference, tokens["batch"], beta, loss_type)
        gaps = {m: abs(hand[m] - h[m]) for m in hand}
        worst = max(worst, abs(hand["loss"] - h["loss"]) / abs(h["loss"]))
        print(f"  step {k} by hand: " + " ".join(f"{m} {hand[m]:.8g}" for m in hand)
              + f"\n    |by hand - TRL| max {max(gaps.values()):.1e} ({max(gaps, key=gaps.get)})")
    return log, seconds, worst


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        results = [_check(Path(tmp), conv, loss) for conv, loss in
                   ((True, "sigmoid"), (False, "sigmoid"), (True, "ipo"))]
    print("\nloss relative gap by hand vs TRL, worst per run:", [f"{w:.1e}" for _, _, w in results])
    assert all(w < 1e-5 for _, _, w in results)
    assert all(not math.isclose(r[0][0]["loss"], r[0][-1]["loss"]) for r in results)  # it trains
