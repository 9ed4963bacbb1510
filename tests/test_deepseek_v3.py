"""The DeepSeek-V3 family (models/deepseek_v3/: MLA with YaRN and interleaved rope, dense first blocks, DeepSeek's
group-limited sigmoid routing with its selection bias and shared experts) against transformers' DeepseekV3ForCausalLM:
a random one trained by tests/reference.py's plain loop (torch's AdamW, the schedule written there) and by trainer3d
--init-from-hf gives the same loss and gradient norm at every step in one process and at tp 2, tp 2 with sequence
parallelism, pp 2, dp 2 × ep 2 and cp 2 × tp 2, all in one world of 4; a run that learns the bias exports a directory
whose logits, bias (read by transformers) and greedy text are trainer3d's. One process: the router against
transformers' DeepseekV3TopkRouter, the presets against their published sizes, the formulas against what the model
builds and saves, and the config's edges (MTP layers skipped with a note, quantized files refused)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers

from distributed import run_world
from test_llama_hf import OPTIM, SEQ, VOCAB, batches, bpe_tokenizer, reference_run
from trainer3d.config import TrainConfig
from trainer3d.models import MODEL_PRESETS, build_model, plain_model
from trainer3d.train.setup import validate

LR = 1e-3  # routing is discontinuous: tests/test_llama_hf.py's MOE_LR
GB = 8


def hf_deepseek(seed: int = 0, **overrides) -> transformers.DeepseekV3ForCausalLM:
    """A random DeepseekV3ForCausalLM, fp32: q and kv latents, 4 heads of 16 nope + 8 rope dims (interleaved) with 12
    value dims, YaRN (factor 4 with mscale_all_dim: the softmax scale changes too), blocks 0-1 dense and 2-3 MoE with 8
    experts in 4 groups, top-2 from the best 2 groups, a shared expert, routed_scaling_factor 2.5; every weight
    perturbed and every router's e_score_correction_bias non-zero, large enough to change choices."""
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
              topk_group=2, n_shared_experts=1, first_k_dense_replace=2, q_lora_rank=32, kv_lora_rank=24,
              qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=512,
              routed_scaling_factor=2.5, rope_interleave=True,
              rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                               "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                               "mscale_all_dim": 1.0})
    kw.update(overrides)
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**kw))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.copy_(torch.randn(m.e_score_correction_bias.shape) * 0.1)
    return model.eval()


def _train(hf_dir: str, layout: dict, data: torch.Tensor, out_dir: str | None = None) -> dict | None:
    """trainer3d --init-from-hf at `layout` (dp, tp, pp, cp, ep and any TrainConfig flag) on `data`'s global batches;
    on the active ranks: the per-step losses and norms (and with `out_dir`, the saved checkpoint's path)."""
    from trainer3d.checkpoint.load import apply, prepare
    from trainer3d.checkpoint.save import save_checkpoint
    from trainer3d.train.trainer import Trainer

    layout = dict(layout)
    n = layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1) * layout.pop("dp", 1)
    cfg = TrainConfig(init_from_hf=hf_dir, seq_len=SEQ, global_batch=GB, out_dir=out_dir or "runs/unused",
                      **{"micro_batches": 2, **OPTIM, "lr": LR, **layout})
    setup = validate(cfg, n)
    topo = setup.topology(list(range(n)))
    out = None
    if topo.active:
        mcfg = setup.model_config(VOCAB)
        start = prepare(setup.cfg, mcfg, topo)
        trainer = Trainer(setup, topo, torch.device("cpu"), mcfg, shard_value=start.shard_value)
        apply(start, trainer)
        per = GB // setup.layout.dp
        records = [trainer.train_step(b[topo.dp_rank * per:(topo.dp_rank + 1) * per]) for b in data]
        out = {"losses": [r["loss"] for r in records], "norms": [r["grad_norm"] for r in records], "mcfg": mcfg,
               "notes": start.notes, "tables": {k: v.clone() for m in trainer.pm.stages
                                                for k, v in m.state_tables().items()}}
        if out_dir is not None:
            out["path"] = str(save_checkpoint(trainer, out_dir))
    topo.destroy()
    return out


LAYOUTS = {"1x1x1": {}, "tp2": dict(tp=2), "tp2 sp": dict(tp=2, sequence_parallel=True), "pp2": dict(pp=2),
           "dp2 ep2": dict(dp=2, ep=2), "cp2 tp2": dict(cp=2, tp=2)}


def _world(rank, world_size, hf_dir, data, trip_dir, trip_data, run_dir):
    runs = {label: _train(hf_dir, layout, data) for label, layout in LAYOUTS.items()}
    # the round trip: the bias learned (loss-free balancing) at dp 2 × ep 2 × tp 2, saved
    runs["trip"] = _train(trip_dir, dict(dp=2, ep=2, tp=2, moe_bias_update_rate=1e-2), trip_data, run_dir)
    return runs


def test_trains_like_transformers_and_exports(tmp_path, capsys):
    """A random DeepseekV3ForCausalLM trained by transformers in a plain loop and by trainer3d --init-from-hf at six
    layouts: losses and gradient norms within 1e-5 (relative) at every step. Another, trained at dp 2 × ep 2 × tp 2
    with loss-free balancing (rate 1e-2, 4 steps), saved and exported: transformers reads back the biases the
    trainer held (each moved from the imported value by whole steps of ±rate), the export's logits are trainer3d's
    with them (and far from trainer3d's without), and its greedy generation is `trainer3d.sample --temperature 0`'s."""
    from trainer3d.checkpoint.format import Checkpoint
    from trainer3d.export import main as export_main
    from trainer3d.sample import main as sample_main

    hf = hf_deepseek(seed=3)
    hf.save_pretrained(tmp_path / "hf")
    ref_losses, ref_norms = reference_run(hf, batches(), lr=LR)
    trip = hf_deepseek(seed=5)
    trip.save_pretrained(tmp_path / "trip")
    n_tokens = bpe_tokenizer(tmp_path / "trip")
    trip_data = batches(4, vocab=n_tokens)
    results = run_world(4, _world, str(tmp_path / "hf"), batches(), str(tmp_path / "trip"), trip_data,
                        str(tmp_path / "run"), timeout=600)
    ours = results[0]
    report = [f"transformers plain loop: losses {[f'{x:.6f}' for x in ref_losses]}"]
    for label in LAYOUTS:
        run = ours[label]
        loss_rel = max(abs(a - b) / b for a, b in zip(run["losses"], ref_losses))
        norm_rel = max(abs(a - b) / b for a, b in zip(run["norms"], ref_norms))
        report.append(f"trainer3d {label}: loss rel diff {loss_rel:.1e}, grad norm rel diff {norm_rel:.1e}")
        assert loss_rel < 1e-5 and norm_rel < 1e-5, (label, run["losses"], run["norms"], ref_losses, ref_norms)
    assert ref_losses[-1] < ref_losses[0] - 0.05 and max(ref_norms) > OPTIM["grad_clip"]  # it trains; clipping acts
    assert any("multi-token-prediction" in note for note in ours["1x1x1"]["notes"])  # (transformers saves 1)

    run = next(r["trip"] for r in results if r["trip"] is not None and "path" in r["trip"])
    assert export_main([run["path"], str(tmp_path / "export")]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert type(exported) is transformers.DeepseekV3ForCausalLM
    ckpt = Checkpoint(run["path"])
    tables = ckpt.model_tables()
    for i in (2, 3):
        learned = exported.model.layers[i].mlp.gate.e_score_correction_bias  # read back by transformers
        initial = trip.model.layers[i].mlp.gate.e_score_correction_bias
        assert torch.equal(learned, run["tables"][f"layers.{i}.mlp.gate.expert_bias"])  # the trainer's, in memory
        steps = (learned - initial) / 1e-2
        assert steps.abs().max() > 0.5 and torch.allclose(steps, steps.round(), atol=1e-3)
    x = trip_data[0, :, :-1]
    ours_model = plain_model(ckpt.model_config, {**ckpt.model_state(), **tables}, torch.device("cpu"), torch.float32)
    unbiased = plain_model(ckpt.model_config, ckpt.model_state(), torch.device("cpu"), torch.float32)
    with torch.no_grad():
        logits = exported(x).logits
        diff = (ours_model(x) - logits).abs().max().item()
        without = (unbiased(x) - logits).abs().max().item()
    report.append(f"export: logits diff {diff:.1e} (with the bias zeroed: {without:.1e})")
    assert diff < 1e-5 and without > 1e-3

    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    prompt = "the king and queen"
    ids = tok(prompt, return_tensors="pt").input_ids
    greedy = exported.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.eos_token_id)
    capsys.readouterr()
    assert sample_main([run["path"], "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "12"]) == 0
    printed = capsys.readouterr().out.split("\n", 1)[1].rstrip("\n")
    assert printed == tok.decode(greedy[0], skip_special_tokens=True), (printed, greedy)
    with capsys.disabled():
        print("\n" + "\n".join(report))


# ---- one process ------------------------------------------------------------------------------------------------------
def test_router_is_transformers_topk_router():
    """trainer3d's Router with DeepSeek-V3's spec chooses the experts and weights of transformers' DeepseekV3TopkRouter
    (sigmoid scores in fp32, the bias in the choice only, group-limited top-k, renormalized with its 1e-20, times the
    scaling factor), grouped (8 experts in 4 groups, top-2 of 2 groups) and not (Kimi K2's one group), renormalized
    or not; and the bias and the groups each change the choice."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from trainer3d.models.moe import Router

    x = torch.randn(200, 64, generator=torch.Generator().manual_seed(0))
    for n_group, topk_group, norm in ((4, 2, True), (4, 2, False), (1, 1, True)):
        hf_cfg = transformers.DeepseekV3Config(hidden_size=64, n_routed_experts=8, num_experts_per_tok=2,
                                               n_group=n_group, topk_group=topk_group, norm_topk_prob=norm,
                                               routed_scaling_factor=2.5)
        theirs = DeepseekV3TopkRouter(hf_cfg)
        with torch.no_grad():
            theirs.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
            theirs.e_score_correction_bias.normal_(0, 0.3, generator=torch.Generator().manual_seed(2))
        cfg = dataclasses.replace(MODEL_PRESETS["deepseek-v3-tiny"], n_embd=64, n_group=n_group, topk_group=topk_group,
                                  norm_topk_prob=norm)
        ours = Router(64, cfg.moe)
        ours.weight, ours.expert_bias = theirs.weight, theirs.e_score_correction_bias.clone()
        _, scores, experts, weights = ours(x)
        _, their_weights, their_experts = theirs(x)
        order, their_order = experts.sort(-1), their_experts.sort(-1)
        assert torch.equal(order.values, their_order.values), (n_group, topk_group, norm)
        torch.testing.assert_close(weights.gather(-1, order.indices), their_weights.gather(-1, their_order.indices),
                                   rtol=0, atol=0)
        assert weights.dtype == torch.float32  # kept in fp32 for the experts' weighting, as transformers does
        unbiased = scores.topk(2, dim=-1).indices.sort(-1).values
        assert (unbiased != order.values).any(1).float().mean() > 0.2  # the bias moved many choices
    assert cfg.moe.n_groups == 1
    grouped = dataclasses.replace(MODEL_PRESETS["deepseek-v3-tiny"], n_embd=64).moe
    ours = Router(64, grouped)
    ours.weight, ours.expert_bias = theirs.weight, torch.zeros(8)
    plain = Router(64, dataclasses.replace(grouped, n_groups=1, top_groups=1))
    plain.weight, plain.expert_bias = theirs.weight, torch.zeros(8)
    assert not torch.equal(ours(x)[2].sort(-1).values, plain(x)[2].sort(-1).values)  # the groups limit the choice


PUBLISHED = {  # config.json of each, as published (DeepSeek's and Kimi's quantization_config left out: fp8 files)
    "deepseek-v3": {  # deepseek-ai/DeepSeek-V3
        "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0,
        "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
        "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
        "model_type": "deepseek_v3", "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8,
        "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
        "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
        "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
        "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 129280},
    "kimi-k2": {  # moonshotai/Kimi-K2-Instruct (custom code's model_type; its files are DeepSeek-V3's)
        "architectures": ["DeepseekV3ForCausalLM"], "first_k_dense_replace": 1, "hidden_act": "silu",
        "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 131072,
        "model_type": "kimi_k2", "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 1,
        "n_routed_experts": 384, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 64,
        "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 64, "num_nextn_predict_layers": 0,
        "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "rope_theta": 50000.0, "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "tie_word_embeddings": False,
        "topk_group": 1, "topk_method": "noaux_tc", "v_head_dim": 128, "vocab_size": 163840},
    "moonlight-16b-a3b": {  # moonshotai/Moonlight-16B-A3B
        "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 163584, "eos_token_id": 163585, "first_k_dense_replace": 1, "hidden_act": "silu",
        "hidden_size": 2048, "intermediate_size": 11264, "kv_lora_rank": 512, "max_position_embeddings": 8192,
        "model_type": "deepseek_v3", "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1,
        "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": True, "num_attention_heads": 16,
        "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16, "num_nextn_predict_layers": 0,
        "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05,
        "rope_theta": 50000.0, "routed_scaling_factor": 2.446, "scoring_func": "sigmoid", "tie_word_embeddings": False,
        "topk_group": 1, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 163840},
}


@pytest.mark.parametrize("name,total,rel,active", [("deepseek-v3", 671, 1e-3, 37), ("kimi-k2", 1040, 0.015, 32),
                                                   ("moonlight-16b-a3b", 16, 0.005, 3)])
def test_presets_are_the_published_models(name, total, rel, active):
    """Each preset is what its published config.json reads as, and has the published size in billions, to the digits
    published: DeepSeek-V3 671 total, 37 activated (its paper; 671.03 and 36.63 here, the activated count without the
    embedding lookup, as the published counts go); Kimi K2 1040 (its report; 1026.4 here: the report's figure is 1.3%
    above its own config's arithmetic, the model card says "1T") and 32 (31.69); Moonlight 16 and 3 (15.96, 2.58).
    The model built on the meta device holds num_params, and its tp 2 shards add up to it."""
    from trainer3d.models.deepseek_v3.hf import DeepseekV3Adapter
    from trainer3d.parallel.param_counts import local_params

    cfg = MODEL_PRESETS[name]
    assert DeepseekV3Adapter().config_from_hf(PUBLISHED[name]) == cfg
    activated = cfg.num_params(active=True) - cfg.vocab_size * cfg.n_embd
    assert cfg.num_params() / 1e9 == pytest.approx(total, rel=rel) and round(activated / 1e9) == active
    small = dataclasses.replace(cfg, n_layer=cfg.first_k_dense_replace + 1)  # the dense blocks and one MoE block
    with torch.device("meta"):
        built = build_model(small)
    assert sum(p.numel() for p in built.parameters()) == small.num_params()
    for i in (0, small.n_layer - 1):
        block = sum(p.numel() for p in built.blocks[str(i)].parameters())
        assert block == small.block_params(i) == local_params(small, 1).block(i).total()
        halves = local_params(small, 2).block(i).pieces
        assert sum(p.n * (1 if p.replicated else 2) for p in halves) == block


def test_mla_activations_are_what_the_block_saves():
    """The planner's per-layer activation bytes (layer_activations) against what a dense block keeps for its backward
    (CPU, bf16 autocast: tests/test_plan.py's measure), per token: every change of MLA's shape (no q latent, more
    heads, a wider latent, wider rope or nope dims, values as wide as the keys, no YaRN) changes both by the same
    bytes."""
    from test_plan import _saved_bytes
    from trainer3d.plan.candidate import Candidate
    from trainer3d.plan.memory import layer_activation_bytes

    def per_token(**change):
        cfg = dataclasses.replace(MODEL_PRESETS["deepseek-v3-tiny"], n_layer=1, first_k_dense_replace=1, **change)
        torch.manual_seed(0)
        model = build_model(cfg)
        model.init_tables(torch.device("cpu"))
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.02)
        sizes = [_saved_bytes(model.blocks["0"], torch.randn(1, T, cfg.n_embd, requires_grad=True)) for T in (128, 256)]
        planned = layer_activation_bytes(Candidate(cfg=cfg, seq_len=256, precision="bf16-autocast")) / 256
        return (sizes[1] - sizes[0]) / 128, planned

    base = per_token()
    for change in (dict(q_lora_rank=None), dict(n_head=8), dict(kv_lora_rank=64), dict(qk_rope_head_dim=32),
                   dict(qk_nope_head_dim=16), dict(v_head_dim=48), dict(rope_factor=None, rope_interleave=False)):
        measured, planned = per_token(**change)
        assert measured - base[0] == planned - base[1], (change, measured - base[0], planned - base[1])


def _saved(tmp_path, **overrides):
    hf = hf_deepseek(**overrides)
    hf.save_pretrained(tmp_path)
    return hf


def test_config_edges(tmp_path):
    """Multi-token prediction is not built: a directory whose config declares an MTP layer and holds its weights
    (DeepSeek's files keep them as the layer past the last) loads without them, with a note, as transformers loads
    it; an export declares none. Quantized files, another router score or rope type are refused with the reason;
    Kimi K2's `kimi_k2` directories read as DeepSeek-V3. A config's every field survives the export's config.json."""
    from safetensors.torch import load_file, save_file

    from trainer3d.checkpoint.hf import HFDirectory, load_hf_checkpoint
    from trainer3d.models.deepseek_v3.hf import DeepseekV3Adapter

    _saved(tmp_path / "mtp")
    weights = load_file(tmp_path / "mtp" / "model.safetensors")
    for key in [k for k in weights if k.startswith("model.layers.3.")]:  # an MTP layer: a block plus its own parts
        weights[key.replace("model.layers.3.", "model.layers.4.")] = weights[key].clone()
    for part in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"):
        weights[f"model.layers.4.{part}"] = torch.ones(4)
    save_file(weights, tmp_path / "mtp" / "model.safetensors", metadata={"format": "pt"})
    directory = HFDirectory(tmp_path / "mtp")
    directory.check()
    assert len(directory.notes) == 1 and "1 multi-token-prediction layer" in directory.notes[0]
    cfg, state = load_hf_checkpoint(tmp_path / "mtp")
    theirs = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "mtp").eval()
    x = batches(1)[0, :2, :-1]
    with torch.no_grad():
        assert (plain_model(cfg, state, torch.device("cpu"), torch.float32)(x) - theirs(x).logits).abs().max() < 1e-5
    adapter = DeepseekV3Adapter()
    exported = adapter.hf_config(cfg).to_dict()
    assert exported["num_nextn_predict_layers"] == 0 and exported["num_key_value_heads"] == cfg.n_head
    assert adapter.config_from_hf(exported) == cfg
    for preset in ("deepseek-v3", "kimi-k2", "moonlight-16b-a3b", "deepseek-v3-tiny"):
        assert adapter.config_from_hf(adapter.hf_config(MODEL_PRESETS[preset]).to_dict()) == MODEL_PRESETS[preset]

    raw = json.loads((tmp_path / "mtp" / "config.json").read_text())
    for change, reason in (({"quantization_config": {"quant_method": "fp8"}}, "dequantize them to bf16 first"),
                           ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
                           ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "rope_type='llama3'")):
        with pytest.raises(ValueError, match=reason):
            adapter.config_from_hf({**raw, **change})
    assert adapter.config_from_hf({**raw, "model_type": "kimi_k2"}) == cfg


def test_the_tiny_preset_trains_from_the_command_line(tmp_path):
    """`--model deepseek-v3-tiny` (trimmed to one dense and one MoE block) trains from the entry script."""
    import subprocess
    import sys
    from pathlib import Path

    from distributed import launch_env

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, str(root / "launch" / "train.py"), "--model", "deepseek-v3-tiny", "--n-layer", "3",
           "--seq-len", "32", "--global-batch", "2", "--max-steps", "2", "--eval-every", "0", "--no-final-save",
           "--out-dir", str(tmp_path / "run")]
    p = subprocess.run(cmd, env=launch_env(), capture_output=True, text=True, timeout=300, cwd=str(root))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "model=deepseek-v3-tiny (deepseek_v3, " in p.stdout and "trained steps 1-2" in p.stdout, p.stdout[-2000:]
