"""LoRA (issue 73) equals PEFT under TRL step by step: a random Hugging Face Llama and a PEFT adapter over it (B drawn
non-zero, so that every factor has a gradient from step 1), continued by trl.SFTTrainer on the PEFT model and by
trainer3d's entry point with --init-from-hf and --lora-from, at one process, tp 2 with sequence parallelism × pp 2,
tp 2 × dp 2 under ZeRO-3 and pp 2 × dp 2 under ZeRO-1: fp32, the whole conversation set in one batch a step, constant lr (1e-2), AdamW with TRL's
defaults, clipping at 1.0. Per step: the same loss and gradient norm (the adapters', before clipping) within
tests/helpers/parity.py's tolerances. Two target sets: all-linear, and q_proj,v_proj (two of the three blocks of our fused
q|k|v, none of the MLP). Then the run's own export: the adapter directory loads in PeftModel.from_pretrained, its
tensors equal TRL's trained adapter, and the base's every tensor in the checkpoint is bitwise the one it started from."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import datasets
import peft
import pytest
import torch
import transformers
import trl

from helpers.chat_data import chat_tokenizer, conversations
from helpers.distributed import run_world
from test_llama import hf_llama
from test_sft_trl import CHATML, N, STEPS, _trainer3d, compare, metrics, rendered, shapes, t3d_argv

RANK, ALPHA = 4, 8.0
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # (PEFT's target_parameters)
LORA_LR = 1e-2  # (adapters learn at a higher rate than full fine-tuning; 4 steps at test_sft_trl's 1e-3 move little)
TARGETS = {"all-linear": "all-linear", "q,v": ["q_proj", "v_proj"]}
LAYOUTS = {"1 process": (1, []),
           "tp2 sp pp2": (4, ["--tp", "2", "--sequence-parallel", "--pp", "2"]),
           "tp2 dp2 zero3": (4, ["--tp", "2", "--deepspeed_config", "ds_configs/zero3.json"]),
           "pp2 dp2 zero1": (4, ["--pp", "2", "--deepspeed_config", "ds_configs/zero1.json"])}


def adapter(hf_dir, targets, out, std: float = 0.02, seed: int = 3, rank: int = RANK, alpha: float = ALPHA):
    """A PEFT adapter over the model in `hf_dir`: PEFT's A, and B drawn N(0, std) instead of zeros (so that every
    factor has a gradient at step 1 and the policy starts off its base)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    pm = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    pm.save_pretrained(out)
    return out


def trl_peft_run(hf_dir: Path, adapter_dir: Path, template: Path, seq: int, out: Path, lr: float = LORA_LR) -> dict:
    """TRL's SFTTrainer on the PEFT model (the adapter trainable, the base frozen), test_sft_trl's settings."""
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    model = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(hf_dir), adapter_dir,
                                           is_trainable=True)
    args = trl.SFTConfig(
        output_dir=str(out), assistant_only_loss=True, packing=False, chat_template_path=str(template),
        max_length=seq + 1, per_device_train_batch_size=N, gradient_accumulation_steps=1, max_steps=STEPS,
        learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, bf16=False, fp16=False, logging_steps=1,
        report_to="none", save_strategy="no", seed=0, use_cpu=True, disable_tqdm=True)
    data = datasets.Dataset.from_list([{"messages": m} for m in conversations(N, seed=6)])
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
    trainer.remove_callback(transformers.PrinterCallback)
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.train()
    log = [h for h in trainer.state.log_history if "loss" in h]
    trained = {k: v.detach().clone() for k, v in peft.get_peft_model_state_dict(model).items()}
    return {"loss": [h["loss"] for h in log], "grad_norm": [h["grad_norm"] for h in log], "adapter": trained,
            "supervised": int((batch["labels"][:, 1:] != -100).sum())}


def test_lora_sft_equals_trl_peft(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRAINER3D_CACHE", str(tmp_path / "cache"))
    hf_dir = tmp_path / "hf"
    hf_llama(tie=True, seed=5).save_pretrained(hf_dir)
    chat_tokenizer(hf_dir)
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations(N, seed=6)))
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    convs = rendered(tok, CHATML)
    seq, batch = shapes([n for n, _ in convs], False)
    seq += seq % 2  # (split over tp 2 by sequence parallelism; the rows are padded)
    supervised = sum(s for _, s in convs)

    adapters = {name: adapter(hf_dir, targets, tmp_path / f"adapter-{i}") for i, (name, targets) in
                enumerate(TARGETS.items())}
    runs = {layout: {} for layout in LAYOUTS}
    for layout, (_, flags) in LAYOUTS.items():
        for name, directory in adapters.items():
            out = tmp_path / f"t3d-{name}-{layout}".replace(" ", "_").replace(",", "")
            runs[layout][name] = t3d_argv(hf_dir, data, template, seq, batch, False,
                                          [*flags, "--lr", str(LORA_LR), "--min-lr", str(LORA_LR),
                                           "--lora-from", str(directory)], out)
    start = time.perf_counter()
    codes = {layout: dict(zip(argvs, run_world(LAYOUTS[layout][0], _trainer3d, list(argvs.values()),
                                               timeout=600)[0])) for layout, argvs in runs.items()}
    worlds_s = time.perf_counter() - start
    refs = {name: trl_peft_run(hf_dir, d, template, seq, tmp_path / f"trl-{name}") for name, d in adapters.items()}

    lines, failures = [], []
    for name, ref in refs.items():
        assert ref["supervised"] == supervised and ref["loss"][-1] < ref["loss"][0] - 0.05, ref["loss"]  # it trains
        for layout in LAYOUTS:
            label = f"LoRA {name} {layout}"
            if codes[layout][name] != 0:
                failures.append(f"{label}: trainer3d exited {codes[layout][name]}")
                continue
            more, failed = compare(label, ref, metrics(Path(runs[layout][name][-1])), supervised)
            lines, failures = lines + more, failures + failed
    lines.append(f"trainer3d's worlds: {worlds_s:.0f} s")
    lines += exports(hf_dir, tmp_path, {layout: Path(runs[layout]["q,v"][-1]) for layout in LAYOUTS}, refs["q,v"],
                     capsys)
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert not failures, "\n".join(failures)


def exports(hf_dir: Path, tmp: Path, run_dirs: dict[str, Path], ref: dict, capsys) -> list[str]:
    """Every layout's last checkpoint exported with --adapter: PEFT loads it, its tensors equal TRL's trained
    adapter (and each other's: the checkpoints reshard); the merged export's logits equal the PEFT model's, greedy
    generation by transformers on either equals trainer3d.sample's from the checkpoint."""
    from trainer3d.export import main as export
    from trainer3d.sample import main as sample

    lines, adapters = [], {}
    for layout, run in run_dirs.items():
        out = tmp / f"export-{layout}".replace(" ", "_")
        assert export([str(run), str(out), "--adapter"]) == 0
        adapters[layout] = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(hf_dir),
                                                          out).eval()
        got = peft.get_peft_model_state_dict(adapters[layout])
        assert got.keys() == ref["adapter"].keys()
        gap = max((got[k] - ref["adapter"][k]).abs().max().item() for k in got)
        lines.append(f"{layout}: the exported adapter against TRL's trained one, max |difference| {gap:.1e}")
        assert gap < 1e-5, (layout, gap)
    first = next(iter(run_dirs.values()))
    assert export([str(first), str(tmp / "merged")]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp / "merged").eval()
    with_peft = next(iter(adapters.values()))
    ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        tuned = with_peft(ids).logits
        gap = (merged(ids).logits - tuned).abs().max().item()
        with with_peft.disable_adapter():
            base = with_peft(ids).logits
        bare = (base - tuned).abs().max().item()
        base_gap = (base - transformers.AutoModelForCausalLM.from_pretrained(hf_dir)(ids).logits).abs().max().item()
    lines.append(f"merged export's logits against the PEFT model's: {gap:.1e} (the adapter moves them {bare:.1e})")
    assert gap < 1e-5 and bare > 1e-3 and base_gap == 0.0, (gap, bare, base_gap)
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    prompt = tok("hello there", return_tensors="pt").input_ids
    greedy = dict(max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    by_peft = with_peft.generate(input_ids=prompt, **greedy)[0, prompt.shape[1]:]
    by_merged = merged.generate(input_ids=prompt, **greedy)[0, prompt.shape[1]:]
    capsys.readouterr()
    assert sample([str(first), "--prompt", "hello there", "--max-new-tokens", "12", "--temperature", "0",
                   "--eos-token", tok.pad_token or tok.eos_token]) == 0
    text = capsys.readouterr().out.splitlines()[1]
    assert by_peft.tolist() == by_merged.tolist()
    assert text == tok.decode(prompt[0].tolist() + by_peft.tolist()), (text, tok.decode(by_peft))
    lines.append(f"greedy: PEFT, the merged export and trainer3d.sample agree on {len(by_peft)} tokens")
    return lines


def _base_unchanged(hf_dir: str, layout: dict) -> dict:
    """A LoRA trainer built as the entry point builds it, three steps on random tokens: every base tensor this rank
    holds (its ZeRO-3 partition) bitwise as it started, every adapter B moved from zero."""
    from trainer3d.checkpoint.load import apply, prepare
    from trainer3d.config import TrainConfig
    from trainer3d.parallel.lora import is_adapter
    from trainer3d.train.setup import validate
    from trainer3d.train.trainer import Trainer

    n = layout.pop("world")
    cfg = TrainConfig(init_from_hf=hf_dir, lora_rank=RANK, seq_len=32, global_batch=4, precision="fp32",
                      max_steps=3, lr=1e-2, warmup_steps=0, val_fraction=0.0, eval_every=0, **layout)
    setup = validate(cfg, n)
    topo = setup.topology(list(range(n)))
    mcfg = setup.model_config(1000)
    start = prepare(setup.cfg, mcfg, topo)
    trainer = Trainer(setup, topo, torch.device("cpu"), mcfg, shard_value=start.shard_value)
    apply(start, trainer)

    def held(p):  # (ZeRO-3 keeps this rank's partition apart from the gathered parameter)
        return (p.ds_tensor if hasattr(p, "ds_tensor") else p.data).detach().clone()

    params = [(name, p) for s in trainer.parallel_model.stages for name, p in s.named_parameters()]
    before = {name: held(p) for name, p in params}
    gen = torch.Generator().manual_seed(topo.dp_rank)
    for _ in range(3):
        trainer.train_step(torch.randint(0, 1000, (4 // setup.layout.dp, 33), generator=gen))
    after = {name: held(p) for name, p in params}
    topo.destroy()
    base = [name for name in before if not is_adapter(name)]
    return {"base": len(base), "changed": [name for name in base if not torch.equal(before[name], after[name])],
            "B still zero": [name for name in before if name.endswith(".B") and not after[name].abs().max() > 0]}


def _engine_stream(hf_dir: str, layout: dict, out_dir: str) -> dict:
    """trainer3d.engine on a LoRA run, one step: named_weights() (merged) and named_weights(adapters=True), then its
    checkpoint exported merged and as a PEFT directory (on rank 0): the largest difference of each stream from its
    export."""
    from safetensors.torch import load_file

    from trainer3d.config import TrainConfig
    from trainer3d.engine import Engine
    from trainer3d.export import export, export_adapter

    cfg = TrainConfig(init_from_hf=hf_dir, lora_rank=RANK, lora_targets="q_proj,v_proj,down_proj", seq_len=32,
                      global_batch=4, precision="fp32", lr=1e-2, warmup_steps=0, max_steps=10, out_dir=out_dir,
                      **layout)
    engine = Engine(cfg, ranks=[0, 1])
    tokens = torch.randint(0, 1000, (4, 33), generator=torch.Generator().manual_seed(2))
    engine.forward_backward(tokens, lambda logprobs, f: -logprobs)
    engine.step()
    merged, adapters = dict(engine.named_weights()), dict(engine.named_weights(adapters=True))
    saved = engine.save(out_dir)
    engine.close()
    if torch.distributed.get_rank() != 0:
        return {}
    export(saved, f"{out_dir}/merged", tokenizer="none")
    export_adapter(saved, f"{out_dir}/adapter")
    want_merged, want_adapters = load_file(f"{out_dir}/merged/model.safetensors"), \
        load_file(f"{out_dir}/adapter/adapter_model.safetensors")
    base = load_file(f"{hf_dir}/model.safetensors")
    assert merged.keys() == want_merged.keys() and adapters.keys() == want_adapters.keys()
    return {"merged": max((merged[k] - want_merged[k]).abs().max().item() for k in merged),
            "adapters": max((adapters[k] - want_adapters[k]).abs().max().item() for k in adapters),
            "moved": max((merged[k] - base[k]).abs().max().item() for k in merged if k in base)}


def _bf16_base(source: dict, layout: dict) -> dict:
    """Three bf16 LoRA steps of the model `source` names (init_from_hf or a preset) under DDP and autocast with the
    frozen base's matmul weights held in bf16 (parallel/lora.hold_base_in) and with it patched out (fp32 copies):
    (loss, grad norm) of each, the bytes of this rank's parameters, and the elements of its frozen bf16 ones; the
    frozen >= 2-D parameters still in fp32 by name."""
    from trainer3d.checkpoint.load import apply, prepare
    from trainer3d.config import TrainConfig
    from trainer3d.parallel import parallelize
    from trainer3d.parallel.lora import LoRASpec
    from trainer3d.plan.candidate import Candidate
    from trainer3d.plan.memory import estimate_memory
    from trainer3d.train.setup import validate
    from trainer3d.train.trainer import Trainer

    out = {}
    for held in (True, False):
        cfg = TrainConfig(**source, lora_rank=RANK, seq_len=32, global_batch=4, precision="bf16",
                          max_steps=3, lr=1e-2, warmup_steps=0, val_fraction=0.0, eval_every=0, **layout)
        setup = validate(cfg, 2)
        topo = setup.topology([0, 1])
        start = prepare(setup.cfg, setup.model_config(1000), topo)
        cast = parallelize.hold_base_in
        parallelize.hold_base_in = cast if held else (lambda stages, dtype: None)
        try:
            trainer = Trainer(setup, topo, torch.device("cpu"), setup.model_config(1000), shard_value=start.shard_value)
        finally:
            parallelize.hold_base_in = cast
        apply(start, trainer)
        gen = torch.Generator().manual_seed(topo.dp_rank)
        steps = [trainer.train_step(torch.randint(0, 1000, (4 // setup.layout.dp, 33), generator=gen))
                 for _ in range(3)]
        stages = trainer.parallel_model.stages
        embeddings = {id(st.embedding.weight) for st in stages if st.embedding is not None}
        frozen = {n: p for st in stages for n, p in st.named_parameters()
                  if not p.requires_grad and p.dim() >= 2 and id(p) not in embeddings}
        out[held] = {"steps": [(r["loss"], r["grad_norm"]) for r in steps],
                     "bytes": sum(p.numel() * p.element_size() for st in stages for p in st.parameters()),
                     "bf16 elements": sum(p.numel() for p in frozen.values() if p.dtype == torch.bfloat16),
                     "planned": estimate_memory(Candidate(
                         trainer.mcfg, dp=setup.layout.dp, pp=setup.layout.pp, precision="bf16-autocast",
                         lora=LoRASpec.of(cfg)), topo.pp_rank).params,
                     "fp32": sorted(n for n, p in frozen.items() if p.dtype == torch.float32)}
        topo.destroy()
    return out


def _runs_then_bases(rank: int, world_size: int, runs: list[list[str]], hf_dir: str | None, tmp: str) -> dict:
    """The entry point for each argv; then (`hf_dir`) _base_unchanged at tp 2 with sequence parallelism and at dp 2
    under ZeRO-3, and _engine_stream at tp 2 and at dp 2 under ZeRO-3."""
    from trainer3d.train.loop import main

    out = {"codes": [main(argv) for argv in runs]}
    if hf_dir is not None:
        out["bases"] = {label: _base_unchanged(hf_dir, layout) for label, layout in (
            ("tp2 sp", dict(world=2, tp=2, sequence_parallel=True)),
            ("dp2 zero3", dict(world=2, deepspeed_config="ds_configs/zero3.json")))}
        out["streams"] = {label: _engine_stream(hf_dir, layout, f"{tmp}/engine-{label}") for label, layout in (
            ("tp2", dict(tp=2)), ("zero3", dict(deepspeed_config="ds_configs/zero3.json")))}
        out["bf16"] = {label: _bf16_base(source, layout) for label, source, layout in (
            ("dp2", dict(init_from_hf=hf_dir), {}), ("pp2", dict(init_from_hf=hf_dir), dict(pp=2)),
            ("dp2 DSA", dict(model="deepseek-v3.2-tiny"), {}))}
    return out


def test_lora_resume_base_and_refusals(tmp_path, monkeypatch, capsys):
    """A LoRA run saved at step 2 by dp 2 and resumed by tp 2 continues the straight dp 2 run (its checkpoint holds
    the adapters only); a resume with other LoRA flags, or over a base whose files changed, is refused (exit 2); bad
    flags are refused before any process group; the base stays bitwise as loaded; trainer3d.engine streams the
    merged weights, or the adapters alone, as the exports hold them; a bf16 run under DDP holds the frozen base's
    matmul weights in bf16 (DeepSeek-V3.2's replicated latents too, not DSA's fp32 weights_proj), computes bitwise
    what fp32 copies under autocast compute, and holds the parameter bytes the planner counts."""
    monkeypatch.setenv("TRAINER3D_CACHE", str(tmp_path / "cache"))
    hf_dir, moved = tmp_path / "hf", tmp_path / "hf-moved"
    hf_llama(tie=True, seed=5).save_pretrained(hf_dir)
    chat_tokenizer(hf_dir)
    shutil.copytree(hf_dir, moved)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations(N, seed=6)))
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    seq, batch = shapes([n for n, _ in rendered(transformers.AutoTokenizer.from_pretrained(hf_dir), CHATML)], False)
    lora = ["--lora-rank", str(RANK), "--lora-targets", "q_proj,down_proj", "--lr", str(LORA_LR), "--min-lr",
            str(LORA_LR)]

    def argv(name, *flags, base=hf_dir):
        return t3d_argv(base, data, template, seq, batch, False, [*lora, *flags], tmp_path / name)

    runs = [argv("straight"), argv("half", "--max-steps", "2"), argv("half", "--tp", "2", "--resume"),
            argv("half", "--tp", "2", "--resume", "--max-steps", "6", "--lora-rank", "8"),
            argv("moved", "--max-steps", "2", base=moved)]
    first = run_world(2, _runs_then_bases, runs, None, str(tmp_path), timeout=600)[0]
    hf_llama(tie=True, seed=6).save_pretrained(moved)  # another model of the same shape in the base's place
    second = run_world(2, _runs_then_bases, [argv("moved", "--resume", "--max-steps", "4", base=moved)],
                       str(hf_dir), str(tmp_path), timeout=600)[0]
    assert first["codes"] == [0, 0, 0, 2, 0] and second["codes"] == [2], (first, second)
    straight, resumed = metrics(tmp_path / "straight"), metrics(tmp_path / "half")
    assert len(resumed["loss"]) == STEPS
    for key in ("loss", "grad_norm"):
        assert max(abs(a - b) / abs(a) for a, b in zip(straight[key][2:], resumed[key][2:])) < 1e-5, key
    meta = json.loads((tmp_path / "half" / "checkpoints" / "step_000004" / "meta.json").read_text())
    saved = {key.split("/")[1].split("@")[0] for f in meta["files"].values() for key in f["tensors"]
             if key.startswith("param/")}
    assert saved and all(".lora." in name for name in saved), saved
    assert meta["lora"]["base"]["path"] == str(hf_dir.resolve()) and meta["lora"]["targets"] == ["q_proj", "down_proj"]
    for label, got in second["bases"].items():
        assert got["base"] > 0 and not got["changed"] and not got["B still zero"], (label, got)
    for label, got in second["bf16"].items():  # the same steps, bitwise, on fewer bytes (pp2: the tied head's copy)
        saved = got[False]["bytes"] - got[True]["bytes"]
        assert got[True]["steps"] == got[False]["steps"] and saved == 2 * got[True]["bf16 elements"] > 0, got
        # every frozen matmul weight held, MLA's replicated latents too; DSA's weights_proj and the routers in fp32
        fp32, dsa = got[True]["fp32"], label == "dp2 DSA"
        allowed = ("mlp.gate.weight", "indexer.weights_proj.weight") if dsa else ()
        assert all(n.endswith(allowed) for n in fp32) and any("weights_proj" in n for n in fp32) == dsa, (label, fp32)
        assert got[False]["bf16 elements"] == 0, label
        # the planner's bytes for this rank's parameters: the held base (norms and routers with it), to 1%
        assert abs(got[True]["planned"] / got[True]["bytes"] - 1) < 0.01, (label, got[True])
    for label, got in second["streams"].items():  # the engine's weights: merged, or the adapters, as exported
        assert got["merged"] < 1e-6 and got["adapters"] < 1e-6 and got["moved"] > 1e-4, (label, got)

    from trainer3d.train.loop import main
    refused = {"give their rank with --lora-rank": ["--lora-alpha", "4"],
               "--lora-targets names wq, which is no linear": ["--lora-rank", "4", "--lora-targets", "wq"],
               "--lora-rank 200 is wider than": ["--lora-rank", "200", "--lora-targets", "q_proj"],
               "give that base with --init-from-hf": ["--lora-from", str(tmp_path)]}
    capsys.readouterr()
    for sentence, flags in refused.items():
        assert main(["--model", "llama-tiny", "--max-steps", "1", *flags, "--out-dir", str(tmp_path / "x")]) == 2
        assert sentence in capsys.readouterr().err, sentence
    assert not (tmp_path / "x").exists()


EXPERT_LAYOUTS = {"1 process": (1, []), "dp2 ep2": (2, ["--ep", "2"]), "tp2": (2, ["--tp", "2"]),
                  "dp2 ep2 zero2": (2, ["--ep", "2", "--deepspeed_config", "ds_configs/zero2.json"])}


def test_lora_experts_equal_peft(tmp_path, monkeypatch, capsys):
    """A random Qwen3-MoE (block 0 dense, the others 8 experts, top 2) with a PEFT adapter on attention's linears
    and on the experts' stacked weights (target_parameters gate_up_proj, down_proj: a pair per expert),
    B drawn non-zero, continued by TRL's SFTTrainer on the PEFT model and by trainer3d --lora-from at 1 process,
    dp 2 × ep 2 (the experts' pairs split with them), tp 2 (tokens split over tp) and dp 2 × ep 2 under ZeRO-2 (the
    experts' own engine): per step the same loss and
    gradient norm; each run's --adapter export loads in PeftModel.from_pretrained and equals TRL's trained adapter,
    its expert tensors in PEFT's nested keys and interleaved layout."""
    from test_llama_hf import hf_moe

    moe = hf_moe("qwen3", seed=3)
    moe.config.router_aux_loss_coef = 0.0  # (TRL's SFTTrainer adds transformers' balance loss where it is set)
    # attention's linears (PEFT 0.21 turns MLP names or all-linear on a MoE into more target_parameters, the router's
    # weight and gate_up at twice the rank by a rank_pattern, which --lora-from refuses with one sentence)
    _against_peft(moe, ["q_proj", "k_proj", "v_proj", "o_proj"], True, EXPERT_LAYOUTS, "LoRA with experts", tmp_path,
                  monkeypatch, capsys)


MLA_LAYOUTS = {"1 process": (1, []), "tp2 sp": (2, ["--tp", "2", "--sequence-parallel"]),
               "tp2": (2, ["--tp", "2"])}


def test_lora_mla_and_shared_experts_equal_peft(tmp_path, monkeypatch, capsys):
    """A random DeepSeek-V3 (MLA with q and kv latents, blocks 0-1 dense, 2-3 with 8 routed experts and a shared
    one) with a PEFT adapter on every linear of the blocks, the tp-replicated ones included (MLA's q_a_proj and
    kv_a_proj_with_mqa, the shared expert's gate/up/down), and on the routed experts: per step the same loss and norm
    as TRL + PEFT at 1 process, tp 2 with sequence parallelism (the replicated pairs see a sequence shard) and tp 2
    (the mixture's tokens split over tp, the latents' whole), and the same trained adapter. PEFT 0.21 rewrites MLP
    names on a transformers-5 MoE into the experts' target_parameters (its v4 -> v5 conversion), which would leave the
    dense and shared MLPs without pairs, so the reference runs PEFT's LoRA layers with that rewrite off."""
    import peft.utils.transformers_weight_conversion as conversion
    from test_deepseek_v3 import hf_deepseek

    monkeypatch.setattr(conversion, "convert_peft_config_for_transformers", lambda *args, **kwargs: None)
    linears = ["q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
               "down_proj"]
    _against_peft(hf_deepseek(seed=3), linears, True, MLA_LAYOUTS, "LoRA on MLA and shared experts", tmp_path,
                  monkeypatch, capsys)


def test_lora_gated_deltanet_equals_peft(tmp_path, monkeypatch, capsys):
    """A random Qwen3.5 (Gated DeltaNet blocks and gated attention) with a PEFT adapter on all-linear: the linear
    attention's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a (one fused column-parallel linear of six blocks here,
    q|k|v spanning three) and out_proj included. At 1 process and tp 2 with sequence parallelism: per step the same
    loss and norm as TRL + PEFT, and the same trained adapter."""
    from test_qwen3_5 import hf_qwen35

    _against_peft(hf_qwen35(seed=3), "all-linear", False, {"1 process": (1, []), "tp2 sp": MLA_LAYOUTS["tp2 sp"]},
                  "LoRA on Gated DeltaNet", tmp_path, monkeypatch, capsys)


def _against_peft(hf_model, linears, experts: bool, layouts: dict, label: str, tmp_path, monkeypatch, capsys):
    """`hf_model` with a PEFT adapter on `linears` (and the experts), B drawn non-zero, continued by TRL + PEFT and by
    trainer3d --lora-from at each of `layouts`; each run's --adapter export loaded by PEFT equals TRL's adapter."""
    from test_llama_hf import MOE_LR
    from trainer3d.export import main as export

    monkeypatch.setenv("TRAINER3D_CACHE", str(tmp_path / "cache"))
    hf_dir = tmp_path / "hf"
    hf_model.save_pretrained(hf_dir)
    chat_tokenizer(hf_dir)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations(N, seed=6)))
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    convs = rendered(transformers.AutoTokenizer.from_pretrained(hf_dir), CHATML)
    seq, batch = shapes([n for n, _ in convs], False)
    seq += seq % 2
    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(hf_dir), peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=linears, target_parameters=EXPERT_PARAMETERS if experts else None))
    if experts:  # (PEFT's v4 -> v5 conversion rewrote none of the targets)
        assert sorted(model.peft_config["default"].target_modules) == sorted(linears)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    model.save_pretrained(tmp_path / "adapter")
    runs = {layout: t3d_argv(hf_dir, data, template, seq, batch, False,
                             [*flags, "--lr", str(MOE_LR), "--min-lr", str(MOE_LR), "--lora-from",
                              str(tmp_path / "adapter")], tmp_path / layout.replace(" ", "_"))
            for layout, (_, flags) in layouts.items()}
    codes = {layout: run_world(layouts[layout][0], _trainer3d, [argv], timeout=600)[0][0]
             for layout, argv in runs.items()}
    ref = trl_peft_run(hf_dir, tmp_path / "adapter", template, seq, tmp_path / "trl", lr=MOE_LR)
    lines, failures = [], []
    for layout, argv in runs.items():
        if codes[layout] != 0:
            failures.append(f"{layout}: trainer3d exited {codes[layout]}")
            continue
        more, failed = compare(f"{label} {layout}", ref, metrics(Path(argv[-1])), ref["supervised"])
        lines, failures = lines + more, failures + failed
        out = tmp_path / f"export-{layout}".replace(" ", "_")
        assert export([argv[-1], str(out), "--adapter"]) == 0
        loaded = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(hf_dir), out)
        got = peft.get_peft_model_state_dict(loaded)
        assert got.keys() == ref["adapter"].keys() and any("experts" in k for k in got) == experts
        gap = max((got[k] - ref["adapter"][k]).abs().max().item() for k in got)
        lines.append(f"{layout}: the exported adapter against TRL's trained one, max |difference| {gap:.1e}")
        failures += [f"{layout}: adapter {gap:.1e}"] if gap > 1e-5 else []
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert ref["loss"][-1] < ref["loss"][0], ref["loss"]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("preset", ["qwen3-moe-tiny", "mixtral-tiny", "deepseek-v3-tiny", "qwen3.5-moe-tiny"])
def test_expert_adapters_are_peft_keys_of_every_mixture(preset):
    """For every family with a mixture, an --adapter export's experts are what PEFT builds on transformers' model of
    the same config (target_parameters on the experts' stacked weights): the same keys, the same shapes, and the
    target_parameters it writes. (Mixtral's checkpoint files name its experts block_sparse_moe.experts.N.w1;
    transformers 5 holds them at mlp.experts, where PEFT looks.)"""
    from trainer3d.checkpoint.peft import peft_config, peft_tensors
    from trainer3d.models import MODEL_PRESETS, family_of
    from trainer3d.parallel.lora import LoRASpec, adapter_shapes

    mcfg, spec = MODEL_PRESETS[preset], LoRASpec(RANK, ALPHA, targets=("experts",))
    model = transformers.AutoModelForCausalLM.from_config(family_of(mcfg).hf.hf_config(mcfg, torch.float32))
    theirs = peft.get_peft_model_state_dict(peft.get_peft_model(model, peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=[], target_parameters=EXPERT_PARAMETERS)))
    ours = peft_tensors(mcfg, spec, {n: torch.zeros(s) for n, s in adapter_shapes(mcfg, spec).items()})
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in theirs.items()}
    assert peft_config(mcfg, spec, None)["target_parameters"] == EXPERT_PARAMETERS


def test_expert_pairs_grouped_equal_the_loop(monkeypatch):
    """The experts' pairs through torch._grouped_mm (where its rules hold) give the loop's output and gradients, an
    expert with no token included (its pairs' gradients zero)."""
    import trainer3d.parallel.lora as lora
    from trainer3d.models.moe import Experts, MoESpec

    torch.manual_seed(0)
    experts = Experts(32, MoESpec(n_experts=4, top_k=1, expert_hidden=16))
    torch.nn.init.normal_(experts.gate_up_proj, std=0.1), torch.nn.init.normal_(experts.down_proj, std=0.1)
    experts.lora = lora.ExpertLoRA(experts, lora.LoRASpec(4, 8.0, targets=("experts",)), "cpu")
    for p in experts.lora.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x, counts = torch.randn(24, 32), torch.tensor([10, 0, 6, 8])
    assert lora.grouped_mm_applies(x, experts.gate_up_proj, experts.down_proj)  # (this machine's torch has it)
    runs = []
    for grouped in (True, False):
        if not grouped:
            monkeypatch.setattr(lora, "grouped_mm_applies", lambda *args: False)
        experts.zero_grad()
        y = experts(x, counts)
        y.square().sum().backward()
        runs.append([y.detach(), *(p.grad.clone() for p in experts.lora.parameters())])
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(*runs))
    assert runs[0][1][1].abs().sum() == 0 and runs[0][1][0].abs().sum() > 0  # expert 1's A: no token, no gradient
