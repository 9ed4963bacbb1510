"""--objective dpo against TRL's DPOTrainer (tests/helpers/trl_dpo_reference.py): a random Llama with a chat tokenizer, 16
conversational preference pairs, the whole set one batch a step, fp32, a constant lr. Per step the loss, the gradient
norm and TRL's rewards/chosen, rewards/rejected and rewards/margins (and accuracies once the policy has moved) equal
TRL's, at one process, tp2·pp2 and ZeRO-3 at dp4 (sigmoid), and at one process for IPO, robust DPO and another model
as the reference (--ref-model), hinge, sppo_hard, and MPO's mix of sigmoid, bco_pair and sft with TRL's loss_weights (at one process and dp4); TRL's
logps/* and logits/* too; after the steps, the evaluation of 8 held-out pairs (--val-data) equals TRL's evaluate() on
them as eval_dataset in every run (val_loss and each eval_ metric); the pairs' tokens equal TRL's, conversational and
plain text; bad pairs are dropped and counted or refused; the CLI writes the metrics."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from helpers.distributed import launch_env, run_world
from test_lora import adapter
from helpers.trl_dpo_reference import preference_rows, tiny_chat_model, trl_dpo_run, trl_dpo_tokenized
from trainer3d.config import TrainConfig

STEPS, LR, BETA, SEQ = 3, 1e-3, 0.1, 64
RUNS = {  # label: (our layout flags, loss, label smoothing)
    "1p": ({}, "sigmoid", 0.0),
    "tp2 pp2": (dict(tp=2, pp=2), "sigmoid", 0.0),
    "zero3 dp4": (dict(dp=4, deepspeed_config="ds_configs/zero3.json"), "sigmoid", 0.0),  # DeepSpeed: the whole world
    "1p ipo": ({}, "ipo", 0.0),
    "1p robust": ({}, "robust", 0.1),
    "1p ref-model": (dict(ref_model="REF"), "sigmoid", 0.0),  # another model as the reference (TRL's ref_model=)
    # a PEFT adapter (B non-zero) continued at tp 2 × pp 2 against TRL on the PEFT model: the reference is the policy
    # it starts from, base and adapter (TRL's frozen "ref" copy of the adapter), not the base alone
    "tp2 pp2 lora": (dict(tp=2, pp=2, lora_from="ADAPTER"), "sigmoid", 0.0),
    "1p hinge": ({}, "hinge", 0.0),
    "1p sppo_hard": ({}, "sppo_hard", 0.0),
    "1p mix": (dict(dpo_loss_weights="0.8,0.2,1.0"), "sigmoid,bco_pair,sft", 0.0),  # MPO, TRL's loss_weights
    "dp4 mix": (dict(dp=4, dpo_loss_weights="0.8,0.2,1.0"), "sigmoid,bco_pair,sft", 0.0),  # sft's mean over dp
    # padding-free (TRL's padding_free): the 16 pairs packed into 8 rows of 129 tokens, several pairs a row, each side
    # a document of its own; the whole set a step, as TRL's batch; sft's chosen tokens counted per document
    "1p padding-free": (dict(dpo_padding_free=True), "sigmoid", 0.0),
    "tp2 pp2 padding-free": (dict(tp=2, pp=2, dpo_padding_free=True), "sigmoid", 0.0),
    "dp2 padding-free mix": (dict(dp=2, dpo_padding_free=True, dpo_loss_weights="0.8,0.2,1.0"),
                             "sigmoid,bco_pair,sft", 0.0),
}
PF_SEQ, PF_ROWS = 128, 8  # padding-free: the row, and how many rows the fixture's 16 pairs fill (checked)


def write_rows(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def _dpo_run(model_dir, data, val_data, layout, loss, smoothing, out_dir):
    """The CLI's pieces (loop.py): pairs and the --val-data pairs, loader, trainer, the references scored, the
    evaluation of the val pairs before training, STEPS steps, the evaluation after them."""
    from trainer3d.checkpoint.load import apply, prepare
    from trainer3d.data import BatchLoader
    from trainer3d.data.preference import build_pairs
    from trainer3d.train.data_setup import build_val_pairs
    from trainer3d.train.dpo import evaluate, load_or_score
    from trainer3d.train.loop import score_with_reference
    from trainer3d.train.setup import data_config, validate
    from trainer3d.train.trainer import Trainer

    layout = {k: {"REF": f"{model_dir}-ref", "ADAPTER": f"{model_dir}-adapter"}.get(v, v) if isinstance(v, str) else v
              for k, v in layout.items()}
    n = layout.get("tp", 1) * layout.get("pp", 1) * layout.pop("dp", 1)
    padding_free = layout.get("dpo_padding_free", False)
    seq, rows = (PF_SEQ, PF_ROWS) if padding_free else (SEQ, 32)
    cfg = TrainConfig(init_from_hf=model_dir, objective="dpo", data_format="preference", data=data, seq_len=seq,
                      global_batch=rows, micro_batches=2, precision="fp32", lr=LR, warmup_steps=0, min_lr=LR,
                      beta2=0.999, weight_decay=0.0, grad_clip=1.0, dpo_beta=BETA, dpo_loss=loss,
                      dpo_label_smoothing=smoothing, max_steps=STEPS, out_dir=out_dir, val_data=val_data,
                      eval_every=STEPS, **layout)
    setup = validate(cfg, n)
    topo = setup.topology(list(range(n)))
    out = None
    if topo.active:
        pairs = build_pairs(data_config(setup.cfg), seq, padding_free)
        assert not padding_free or (len(pairs), pairs.stats["pairs"]) == (PF_ROWS, 16), pairs.stats  # all, one step
        val = build_val_pairs(setup.cfg, data_config(setup.cfg))
        loader = BatchLoader(pairs, rows if padding_free else rows // 2, topo.dp_rank, setup.layout.dp, setup.cfg.seed)
        mcfg = setup.model_config(pairs.vocab_size)
        start = prepare(setup.cfg, mcfg, topo)
        if setup.cfg.ref_model:
            score_with_reference(setup, topo, torch.device("cpu"), mcfg, pairs, out_dir, val)
        trainer = Trainer(setup, topo, torch.device("cpu"), mcfg, shard_value=start.shard_value, boundary=pairs.eos_id)
        apply(start, trainer, loader)
        load_or_score(trainer, pairs, out_dir, fresh=True, val_rows=val)
        before = evaluate(trainer)
        out = {"steps": [trainer.train_step(loader.next_batch()) for _ in range(STEPS)], "val_before": before,
               "val": evaluate(trainer)}
    topo.destroy()
    return out


def _world(rank, world_size, model_dir, data, val_data, tmp):
    return {label: _dpo_run(model_dir, data, val_data, layout, loss, eps, f"{tmp}/{label.replace(' ', '_')}")
            for label, (layout, loss, eps) in RUNS.items()}


def test_dpo_equals_trl(tmp_path):
    model_dir, rows = tmp_path / "model", preference_rows(16, conversational=True)
    val_rows = preference_rows(8, conversational=True, seed=1)  # --val-data: TRL's eval_dataset
    tiny_chat_model(model_dir)
    tiny_chat_model(f"{model_dir}-ref", seed=6)
    adapter(model_dir, "all-linear", f"{model_dir}-adapter", std=0.05, seed=7, rank=4, alpha=8.0)
    write_rows(tmp_path / "pairs.jsonl", rows)
    write_rows(tmp_path / "val.jsonl", val_rows)
    ours = run_world(4, _world, str(model_dir), str(tmp_path / "pairs.jsonl"), str(tmp_path / "val.jsonl"),
                     str(tmp_path / "runs"), timeout=900)[0]
    refs, evals = {}, {}
    for flags, loss, eps in RUNS.values():
        key, keep = _key(flags, loss, eps), {}
        refs[key] = trl_dpo_run(
            str(model_dir), rows, STEPS, LR, BETA, loss, eps, out_dir=str(tmp_path / loss), keep=keep,
            ref_model_dir=f"{model_dir}-ref" if "ref_model" in flags else None, eval_rows=val_rows,
            adapter_dir=f"{model_dir}-adapter" if "lora_from" in flags else None,
            **({"loss_weights": [float(w) for w in flags["dpo_loss_weights"].split(",")]}
               if "dpo_loss_weights" in flags else {}))
        evals[key] = keep["evaluation"]
    for label, (flags, loss, eps) in RUNS.items():
        ref, run = refs[_key(flags, loss, eps)], ours[label]["steps"]
        print(f"\n{label}: TRL losses {[r['loss'] for r in ref]}, ours {[r['loss'] for r in run]}")
        for step, (r, o) in enumerate(zip(ref, run)):
            for key in ("loss", "grad_norm"):
                assert abs(o[key] - r[key]) <= 1e-5 * abs(r[key]), (label, step, key, o[key], r[key])
            for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
                assert abs(o[key] - r[key]) <= 1e-5 * max(1.0, abs(r[key])), (label, step, key, o[key], r[key])
            for key in ("logits/chosen", "logits/rejected"):  # ~0.01 here, ours 1e-8 apart after two steps
                assert abs(o[key] - r[key]) <= 1e-7, (label, step, key, o[key], r[key])
            if step or "ref_model" in flags:  # at step 1 every reward is 0 up to rounding but with --ref-model
                assert o["rewards/accuracies"] == r["rewards/accuracies"], (label, step)
        assert run[-1]["rewards/margins"] > (0.02 if "lora_from" in flags else 0.05)  # it learns the preference
        # (the adapters, a few percent of the weights, learn it more slowly at the same lr)
        # --val-data after the steps: TRL's evaluate() of the same pairs (eval_ names, ours val_)
        trl_eval, val = evals[_key(flags, loss, eps)], ours[label]["val"]
        print(f"{label}: TRL eval_loss {trl_eval['eval_loss']:.6f}, ours val_loss {val['val_loss']:.6f}")
        for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                    "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected"):
            r, o = trl_eval[f"eval_{key}"], val[f"val_{key}"]
            assert abs(o - r) <= 1e-5 * max(1.0, abs(r)), (label, key, o, r)
        if "ref_model" not in flags and loss == "sigmoid":  # before any step the policy is the reference: ln 2
            assert abs(ours[label]["val_before"]["val_loss"] - 0.6931472) < 1e-6, ours[label]["val_before"]
        assert val["val_loss"] != ours[label]["val_before"]["val_loss"]
    assert refs[_key({}, "sigmoid", 0.0)][-1]["loss"] != refs[_key({}, "robust", 0.1)][-1]["loss"]  # robust's ε acts
    assert abs(refs[_key({"ref_model": 1}, "sigmoid", 0.0)][0]["loss"] - 0.6931472) > 1e-3  # another reference


def _key(flags: dict, loss: str, eps: float) -> tuple:
    """Runs that TRL trains alike share its run."""
    return loss, eps, "ref_model" in flags, "lora_from" in flags




@pytest.mark.parametrize("conversational", [True, False])
def test_pairs_tokenized_as_trl(tmp_path, conversational):
    from trainer3d.data.preference import encode_pair
    from trainer3d.data.tokenizer import load_tokenizer

    tiny_chat_model(tmp_path / "model")
    rows = preference_rows(8, conversational=conversational)
    trl = trl_dpo_tokenized(str(tmp_path / "model"), rows, out_dir=str(tmp_path / "trl"))
    tok = load_tokenizer(str(tmp_path / "model"))
    ours = [encode_pair(tok, row) for row in rows]
    assert [list(p) for p, _, _ in ours] == [list(x) for x in trl["prompt_ids"]]
    assert [list(c) for _, c, _ in ours] == [list(x) for x in trl["chosen_ids"]]
    assert [list(r) for _, _, r in ours] == [list(x) for x in trl["rejected_ids"]]


def test_cli_counts_bad_pairs_and_logs_rewards(tmp_path):
    """Bad pairs dropped and named (or refused under --on-bad-row error, exit 2 before training), TRL's metric names in
    metrics.jsonl, the reference log-probs kept in the run's directory."""
    tiny_chat_model(tmp_path / "model")
    rows = preference_rows(8) + [{"prompt": "a", "chosen": " same", "rejected": " same"}, {"prompt": "b", "chosen": " x"}]
    write_rows(tmp_path / "pairs.jsonl", rows)
    cmd = [sys.executable, "launch/train.py", "--init-from-hf", str(tmp_path / "model"), "--objective", "dpo",
           "--data-format", "preference", "--data", str(tmp_path / "pairs.jsonl"), "--seq-len", "64",
           "--global-batch", "8", "--max-steps", "2", "--log-every", "1", "--out-dir", str(tmp_path / "run")]
    p = subprocess.run(cmd, env=launch_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "preference pairs: 8 from" in p.stdout and "2 dropped (row 8: its chosen and rejected completions are " \
        "identical; row 9: it has no 'rejected')" in p.stdout, p.stdout
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    steps = [r for r in records if "rewards/margins" in r]
    assert len(steps) == 2 and {"rewards/chosen", "rewards/rejected", "rewards/accuracies"} <= set(steps[0])
    assert (tmp_path / "run" / "dpo_reference.npy").exists()
    p = subprocess.run(cmd[:-1] + [str(tmp_path / "run2"), "--on-bad-row", "error"], env=launch_env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "Row 8 of" in p.stderr and "identical" in p.stderr, (p.returncode, p.stderr[-2000:])
    assert not (tmp_path / "run2" / "metrics.jsonl").exists()
    from test_llama import hf_llama

    hf_llama(seed=1, vocab_size=64, hidden_size=32).save_pretrained(tmp_path / "other")
    for ref, said in ((tmp_path, "is not a Hugging Face model directory"), (tmp_path / "other",
                                                                          "is not the policy's architecture")):
        p = subprocess.run(cmd[:-1] + [str(tmp_path / "run3"), "--ref-model", str(ref)], env=launch_env(),
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 2 and said in p.stderr, p.stderr[-2000:]


def test_a_resume_into_a_new_out_dir_keeps_the_reference_and_its_mask(tmp_path):
    """The reference log-probs belong to the checkpoint: a run resumed from step 2 into another --out-dir, at another
    layout (tp2 under torchrun), gives step 3 of the uninterrupted run (re-scoring them with the step-2 policy, as a
    reference kept only in the first run's directory did, zeroes the rewards). Under --document-mask and
    --reset-position-ids on conversational rows (whose chat template closes the user's turn with eos) the reference is
    scored with the rows' own documents, as training sees them: at step 1 the policy is the reference, every reward 0
    and the loss ln 2 (scored by eos-opened documents instead, they were not). The --val-data pairs' reference is the
    checkpoint's too: the resumed run's validation at step 3 is the uninterrupted run's, and at step 0 it is ln 2."""
    from helpers.distributed import free_port

    tiny_chat_model(tmp_path / "model")
    write_rows(tmp_path / "pairs.jsonl", preference_rows(8, conversational=True))
    write_rows(tmp_path / "val.jsonl", preference_rows(6, conversational=True, seed=2))
    flags = ["--init-from-hf", str(tmp_path / "model"), "--objective", "dpo", "--data-format", "preference", "--data",
             str(tmp_path / "pairs.jsonl"), "--val-data", str(tmp_path / "val.jsonl"), "--eval-every", "1",
             "--seq-len", "64", "--global-batch", "8", "--max-steps", "3",
             "--log-every", "1", "--lr", "1e-3", "--min-lr", "1e-3", "--warmup-steps", "0", "--document-mask",
             "--reset-position-ids", "--precision", "fp32"]
    first = subprocess.run([sys.executable, "launch/train.py", *flags, "--save-every", "2", "--out-dir",
                            str(tmp_path / "a")], env=launch_env(), capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
                "--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    resumed = subprocess.run([*torchrun, "launch/train.py", *flags, "--tp", "2", "--resume",
                              str(tmp_path / "a" / "checkpoints" / "step_000002"), "--out-dir", str(tmp_path / "b")],
                             env=launch_env(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = {run: [r for r in map(json.loads, open(tmp_path / run / "metrics.jsonl")) if "rewards/margins" in r]
             for run in ("a", "b")}
    start = steps["a"][0]
    print(f"\nstep 1: {start}\nstep 3: {steps['a'][-1]}\nresumed: {steps['b'][-1]}")
    assert abs(start["loss"] - 0.6931472) < 1e-6 and abs(start["rewards/chosen"]) < 1e-6, start
    assert [r["step"] for r in steps["b"]] == [3]
    for key in ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert abs(steps["b"][0][key] - steps["a"][-1][key]) <= 1e-5 * max(1.0, abs(steps["a"][-1][key])), key
    assert abs(steps["a"][-1]["rewards/margins"]) > 1e-3  # the policy has moved away from the reference
    for name in ("dpo_reference.npy", "dpo_val_reference.npy"):
        reference = np.load(tmp_path / "a" / name, allow_pickle=False)
        assert np.array_equal(np.load(tmp_path / "b" / name, allow_pickle=False), reference), name
    val = {run: {r["step"]: r for r in map(json.loads, open(tmp_path / run / "metrics.jsonl")) if "val_loss" in r}
           for run in ("a", "b")}
    assert abs(val["a"][0]["val_loss"] - 0.6931472) < 1e-6 and sorted(val["a"]) == [0, 1, 2, 3], val["a"]
    assert abs(val["b"][3]["val_loss"] - val["a"][3]["val_loss"]) <= 1e-5, (val["a"][3], val["b"][3])
    assert abs(val["b"][3]["val_rewards/margins"] - val["a"][3]["val_rewards/margins"]) <= 1e-5


@pytest.mark.parametrize("mode", ["keep_start", "keep_end"])
def test_overlong_pairs_truncated_as_trl(tmp_path, mode):
    """TRL's truncation_mode on pairs longer than a row (max_length = our seq_len + 1): each side's tokens and
    completion mask equal TRL's collated batch, and keep_start drops the pairs TRL drops (a prompt that fills the
    row)."""
    from trainer3d.data.preference import encode_pair, fit
    from trainer3d.data.tokenizer import load_tokenizer

    tiny_chat_model(tmp_path / "model")
    rows, width = preference_rows(8, conversational=True), 24  # prompts of 12 to 26 tokens, pairs of 19 to 36
    trl = trl_dpo_tokenized(str(tmp_path / "model"), rows, max_length=width, out_dir=str(tmp_path / "trl"),
                            truncation_mode=mode)
    tok = load_tokenizer(str(tmp_path / "model"))
    pairs = [fit(p, [c, r], width, "truncate", mode) for p, c, r in (encode_pair(tok, row) for row in rows)]
    kept = [p for p in pairs if p is not None]
    full = [encode_pair(tok, row) for row in rows]
    assert any(len(p) + max(len(c), len(r)) > width for p, c, r in full)  # some pairs are overlong
    assert (len(kept) < len(rows)) == (mode == "keep_start") and len(kept) == len(trl["prompt_ids"])
    batch, n = trl["batch"], len(kept)
    for side in range(2):
        for i, sides in enumerate(kept):
            ids, start = sides[side]
            row = side * n + i
            length = int(batch["attention_mask"][row].sum())
            assert ids == batch["input_ids"][row, :length].tolist(), (mode, side, i)
            assert [0] * start + [1] * (len(ids) - start) == batch["completion_mask"][row, :length].tolist()
