"""The families against Hugging Face, trained: random LlamaForCausalLM, GPT2LMHeadModel, Qwen3MoeForCausalLM (with
and without transformers' balance loss) and MixtralForCausalLM, each trained by tests/helpers/reference.py's plain loop
(torch's AdamW, nothing of trainer3d's) and by trainer3d (--init-from-hf) on the same batches, give the same loss and
gradient norm at every step, in one process and at parallel layouts (tp × pp; experts over ep 2 and 4); and the round
trip import -> train at a parallel layout -> save -> export gives a directory that transformers loads with
trainer3d's logits, whose greedy generation is `trainer3d.sample --temperature 0`'s (a tied Llama, a Qwen3-MoE)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from helpers.distributed import run_world
from helpers.reference import plain_loop
from test_hf import _hf_model as hf_gpt2
from test_llama import hf_llama
from trainer3d.checkpoint.load import apply, prepare
from trainer3d.config import TrainConfig
from trainer3d.train.setup import validate

VOCAB, SEQ, GB, STEPS = 1000, 32, 8, 6
OPTIM = dict(lr=3e-3, warmup_steps=2, max_steps=STEPS, grad_clip=0.5, weight_decay=0.1, precision="fp32", seed=7)


def batches(steps: int = STEPS, vocab: int = VOCAB) -> torch.Tensor:
    """Two random global batches, alternating: something to learn in a few steps."""
    pair = torch.randint(0, vocab, (2, GB, SEQ + 1), generator=torch.Generator().manual_seed(11))
    return pair[torch.arange(steps) % 2]


def reference_run(hf, data: torch.Tensor, lr: float = OPTIM["lr"], aux_loss=None) -> tuple[list[float], list[float]]:
    """transformers' model trained by tests/helpers/reference.py's plain loop (torch's AdamW, clip and the documented schedule)
    with the run's hyper-parameters."""
    return plain_loop(hf, data, lr=lr, warmup_steps=OPTIM["warmup_steps"], max_steps=OPTIM["max_steps"],
                      grad_clip=OPTIM["grad_clip"], weight_decay=OPTIM["weight_decay"], aux_loss=aux_loss)


def train_from_hf(hf_dir: str, layout: dict, data: torch.Tensor, out_dir: str | None = None,
                  boundary: int | None = None) -> dict | None:
    """trainer3d --init-from-hf at `layout` (dp, tp, pp, cp, ep, micro_batches and any other TrainConfig flag) on
    `data`'s global batches [steps, batch, seq + 1]; on the active ranks: the per-step losses and gradient norms,
    the MoE balance, MTP and DSA indexer losses, the start's notes, the model's tables, the graphs dynamo compiled, and with
    `out_dir` the saved checkpoint's path. `boundary`: the token that opens a document (--document-mask)."""
    from trainer3d.checkpoint.save import save_checkpoint
    from trainer3d.train.trainer import Trainer

    layout = dict(layout)
    n = layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1) * layout.pop("dp", 1)
    gb, seq = data.shape[1], data.shape[2] - 1
    cfg = TrainConfig(init_from_hf=hf_dir, seq_len=seq, global_batch=gb, out_dir=out_dir or "runs/unused",
                      **{"micro_batches": 2, **OPTIM, **layout})
    setup = validate(cfg, n)
    topo = setup.topology(list(range(n)))
    out = None
    if topo.active:
        mcfg = setup.model_config(VOCAB)
        start = prepare(setup.cfg, mcfg, topo)
        trainer = Trainer(setup, topo, torch.device("cpu"), mcfg, shard_value=start.shard_value, boundary=boundary)
        apply(start, trainer)
        per = gb // setup.layout.dp  # this dp rank's rows of each global batch
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        records = [trainer.train_step(b[topo.dp_rank * per:(topo.dp_rank + 1) * per]) for b in data]
        out = {"losses": [r["loss"] for r in records], "norms": [r["grad_norm"] for r in records], "mcfg": mcfg,
               "aux": [r.get("moe_aux_loss") for r in records], "mtp": [r.get("mtp_loss") for r in records],
               "indexer": [r.get("indexer_loss") for r in records],
               "notes": start.notes, "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs,
               "tables": {k: v.clone() for m in trainer.parallel_model.stages for k, v in m.state_tables().items()}}
        if out_dir is not None:
            out["path"] = str(save_checkpoint(trainer, out_dir))
    topo.destroy()
    return out


def _layouts(rank, world_size, runs, data):
    return [{label: train_from_hf(hf_dir, layout, data) for label, layout in layouts.items()}
            for hf_dir, layouts in runs]


def hf_moe(family: str, seed: int = 0):
    """A random Qwen3-MoE (q/k norms, head_dim 24 != 64/4, block 0 dense through `mlp_only_layers`, top-2 of 8
    renormalized) or Mixtral (top-2 of 4), every weight perturbed."""
    torch.manual_seed(seed)
    if family == "qwen3":
        cfg = transformers.Qwen3MoeConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_experts=8, num_experts_per_tok=2,
            mlp_only_layers=[0], norm_topk_prob=True, router_aux_loss_coef=0.01)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                         num_experts_per_tok=2)
        model = transformers.MixtralForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.eval()


# name -> (model, reference flags, {layout label: trainer3d flags}); MoE rows at lr 1e-3: routing is discontinuous
# (tests/helpers/parity.py's MOE), and transformers computes in another order than trainer3d.
MOE_LR = 1e-3
RUNS = {
    "llama": (lambda: hf_llama(seed=3), {}, {"1x1x1": {}, "tp2 pp2": dict(tp=2, pp=2)}),
    "gpt2": (lambda: hf_gpt2(seed=3), {}, {"1x1x1": {}, "tp2 pp2": dict(tp=2, pp=2)}),
    "qwen3_moe": (lambda: hf_moe("qwen3", seed=3), {"lr": MOE_LR},
                  {"1x1x1": dict(lr=MOE_LR), "dp2 ep2 tp2": dict(dp=2, tp=2, ep=2, lr=MOE_LR),
                   "dp2 ep2 pp2": dict(dp=2, pp=2, ep=2, lr=MOE_LR)}),
    # transformers' pooled balance loss (output_router_logits): one micro-batch, the plain loop's batch
    "qwen3_moe aux": (lambda: hf_moe("qwen3", seed=3), {"lr": MOE_LR, "aux": True},
                      {"1x1x1 hf aux": dict(lr=MOE_LR, micro_batches=1, moe_aux_loss="hf", moe_aux_loss_coef=0.01)}),
    "mixtral": (lambda: hf_moe("mixtral", seed=3), {"lr": MOE_LR},
                {"1x1x1": dict(lr=MOE_LR), "dp4 ep4": dict(dp=4, ep=4, lr=MOE_LR)}),
}


def test_trains_like_transformers_in_a_plain_loop(tmp_path):
    """Llama (grouped-query attention, 3.1's rope scaling, untied), GPT-2 (tied), Qwen3-MoE (with and without
    transformers' balance loss) and Mixtral, each a random transformers model trained by the plain loop and by
    trainer3d --init-from-hf in one process and at parallel layouts (tp and pp; for the mixtures, experts split over
    ep 2 and 4), in one world."""
    refs, runs = {}, []
    for name, (make, ref_flags, layouts) in RUNS.items():
        hf = make()
        hf.save_pretrained(tmp_path / name)
        aux = None
        if ref_flags.get("aux"):
            hf.config.output_router_logits = True
            aux = lambda out, coef=hf.config.router_aux_loss_coef: coef * out.aux_loss  # noqa: E731
        refs[name] = reference_run(hf, batches(), lr=ref_flags.get("lr", OPTIM["lr"]), aux_loss=aux)
        runs.append((str(tmp_path / name), layouts))
    results = run_world(4, _layouts, runs, batches(), timeout=900)
    for (name, (ref_losses, ref_norms)), ours in zip(refs.items(), results[0]):
        print(f"\n{name}: transformers plain loop: losses {[f'{x:.6f}' for x in ref_losses]}")
        for layout, run in ours.items():
            assert run["mcfg"].family == name.split("_")[0], (name, run["mcfg"].family)
            # trainer3d reports the cross-entropy and the balance loss apart; the plain loop's loss is their sum
            losses = [x + (a or 0.0) for x, a in zip(run["losses"], run["aux"])]
            loss_rel = max(abs(a - b) / b for a, b in zip(losses, ref_losses))
            norm_rel = max(abs(a - b) / b for a, b in zip(run["norms"], ref_norms))
            print(f"trainer3d {layout}: loss rel diff {loss_rel:.1e}, grad norm rel diff {norm_rel:.1e}")
            assert loss_rel < 1e-5 and norm_rel < 1e-5, (name, layout, run["losses"], run["norms"])
        assert ref_losses[-1] < ref_losses[0] - 0.05  # it trains
        assert max(ref_norms) > OPTIM["grad_clip"]  # clipping was active
    assert results[0][0]["1x1x1"]["mcfg"].n_kv_heads == 2
    assert results[0][2]["dp2 ep2 tp2"]["mcfg"].moe.n_experts == 8
    aux = results[0][3]["1x1x1 hf aux"]["aux"]
    assert all(0.01 * 2 * 0.9 < a < 0.01 * 8 for a in aux), aux  # the pooled loss (k when balanced) was added


def bpe_tokenizer(directory) -> int:
    """A byte-level BPE with an end-of-text token, trained here on a few sentences; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = ["the king and queen of a small castle were walking in gardens under bright summer skies",
            "while hungry crows watched from old towers near rivers that ran to distant seas"] * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|end_of_text|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end_of_text|>")
    fast.save_pretrained(str(directory))
    return len(fast)


def _round_trip(rank, world_size, hf_dir, layout, data, out_dir):
    return train_from_hf(hf_dir, layout, data, out_dir)


ROUND_TRIPS = {  # family -> (a random transformers model, where trainer3d trains it)
    # a tied Llama (the Llama 3.2 shape): on the last stage the head is a copy of the embedding
    "llama": (lambda: hf_llama(tie=True, seed=5), dict(tp=2, pp=2)),
    # Qwen3-MoE with a dense first block: experts over ep 2, two stages
    "qwen3_moe": (lambda: hf_moe("qwen3", seed=5), dict(dp=2, pp=2, ep=2, lr=MOE_LR)),
}


@pytest.mark.parametrize("family", list(ROUND_TRIPS))
def test_import_train_export_generate(family, tmp_path, capsys):
    """A random transformers model with its own tokenizer: import at a parallel layout, train, save; export;
    AutoModelForCausalLM's logits and greedy text equal trainer3d's."""
    from trainer3d.checkpoint.format import Checkpoint
    from trainer3d.export import main as export_main
    from trainer3d.models import plain_model
    from trainer3d.sample import main as sample_main

    make, layout = ROUND_TRIPS[family]
    hf_dir = tmp_path / "hf"
    hf = make()
    hf.save_pretrained(hf_dir)
    n_tokens = bpe_tokenizer(hf_dir)  # the directory's tokenizer is the run's unless --tokenizer says otherwise
    data = batches(4, vocab=n_tokens)
    results = run_world(4, _round_trip, str(hf_dir), layout, data, str(tmp_path / "run"), timeout=600)
    run = next(r for r in results if r is not None and "path" in r)
    ckpt = Checkpoint(run["path"])
    assert ckpt.meta["model_family"] == family.split("_")[0] and ckpt.meta["config"]["tokenizer"] == str(hf_dir)
    if family == "llama":
        assert all(r["losses"] == run["losses"] for r in results)
        assert ("param", "lm_head.weight") not in ckpt.pieces  # tied: stored once, as the embedding

    capsys.readouterr()
    assert export_main([run["path"], str(tmp_path / "export")]) == 0
    assert f"({type(hf).__name__}, float32)" in capsys.readouterr().out  # what it wrote (a MoE's class, not its family's)
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert type(exported) is type(hf)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")  # the run's tokenizer, exported with it
    assert exported.config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert exported.config.eos_token_id == tok.eos_token_id
    ours = plain_model(ckpt.model_config, ckpt.model_state(), torch.device("cpu"), torch.float32)
    x = data[0, :, :-1]
    with torch.no_grad():
        diff = (ours(x) - exported(x).logits).abs().max().item()
        before = F.cross_entropy(hf(x).logits.reshape(-1, VOCAB), data[0, :, 1:].reshape(-1)).item()
        after = F.cross_entropy(exported(x).logits.reshape(-1, VOCAB), data[0, :, 1:].reshape(-1)).item()
    assert diff < 1e-5, diff
    assert after < before - 0.05  # it trained

    prompt = "the king and queen"
    ids = tok(prompt, return_tensors="pt").input_ids
    greedy = exported.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.eos_token_id)
    capsys.readouterr()
    assert sample_main([run["path"], "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "12"]) == 0
    printed = capsys.readouterr().out.split("\n", 1)[1].rstrip("\n")
    assert printed == tok.decode(greedy[0], skip_special_tokens=True), (printed, greedy)


def test_llama_end_to_end_under_torchrun(tmp_path):
    """The user's commands for a Llama: torchrun at tp 2 × pp 2 with sequence parallelism, HellaSwag and samples at
    every evaluation, a checkpoint; `trainer3d.evaluate` of it in one process gives the HellaSwag the run logged; the
    run resumes at (dp 2, tp 2, pp 1) and goes on."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from helpers.distributed import free_port, launch_env
    from test_hellaswag import REAL_EXAMPLES, write_jsonl

    root = Path(__file__).resolve().parents[1]
    env = launch_env()
    hellaswag = write_jsonl(tmp_path / "hellaswag.jsonl", REAL_EXAMPLES)
    out = tmp_path / "run"
    common = ["--model", "llama-tiny", "--n-layer", "4", "--seq-len", "32", "--global-batch", "8", "--eval-every", "3",
              "--eval-batches", "1", "--eval-hellaswag", str(hellaswag), "--sample-every", "3", "--sample-tokens", "4",
              "--save-every", "3", "--out-dir", str(out), "--log-every", "1"]

    def torchrun(*flags: str, steps: int) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port",
               str(free_port()), str(root / "launch" / "train_gpt2.py"), *common, "--max-steps", str(steps), *flags]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=420, cwd=str(root))
        assert p.returncode == 0, p.stderr[-4000:]
        return p

    first = torchrun("--tp", "2", "--pp", "2", "--sequence-parallel", steps=3)
    assert "(llama, " in first.stdout and "| sample 1:" in first.stdout
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "hellaswag_acc" in r] == [0, 3]
    evaluated = tmp_path / "eval.json"
    p = subprocess.run([sys.executable, "-m", "trainer3d.evaluate", str(out), "--hellaswag", str(hellaswag),
                        "--output", str(evaluated)], env=env, capture_output=True, text=True, timeout=300,
                       cwd=str(root))
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(evaluated.read_text())["hellaswag_acc_sum"] == records[-1]["hellaswag_acc_sum"]
    resumed = torchrun("--tp", "2", "--resume", steps=6)
    assert "resuming from" in resumed.stdout and "layout changed" in resumed.stdout
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 6 and (out / "checkpoints" / "step_000006").is_dir()
