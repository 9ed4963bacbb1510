"""The DeepSeek-V3 family (models/deepseek_v3/: MLA with YaRN and interleaved rope, dense first blocks, DeepSeek's
group-limited sigmoid routing with its selection bias and shared experts) against transformers' DeepseekV3ForCausalLM:
a random one trained by tests/helpers/reference.py's plain loop (torch's AdamW, the schedule written there) and by trainer3d
--init-from-hf gives the same loss and gradient norm at every step in one process and at tp 2, tp 2 with sequence
parallelism, pp 2, dp 2 × ep 2 and cp 2 × tp 2, all in one world of 4; a run that learns the bias exports a directory
whose logits, bias (read by transformers) and greedy text are trainer3d's. Multi-token prediction: a model with an
MTP module (stored as DeepSeek's files store it) trained by trainer3d at 1 process, tp 2, tp 2 with sequence
parallelism, pp 2, cp 2 × tp 2 with sequence parallelism and dp 2 × ep 2 (two modules: 1 process, tp 2, cp 2) gives
the losses and gradient norms of transformers' model plus the module written here from the paper's rule, and its
export loads in transformers. One process: the router against transformers' DeepseekV3TopkRouter, the presets against their
published sizes, the formulas against what the model builds and saves, and the config's edges (MTP layers a file
lacks dropped with a note, quantized files refused, MTP flags refused where they cannot apply)."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
import transformers

from helpers.distributed import run_world
from helpers.reference import adamw, lr_schedule
from test_cli import BASE, launched_alone
from test_llama_hf import OPTIM, VOCAB, batches, bpe_tokenizer, reference_run, train_from_hf
from trainer3d.models import MODEL_PRESETS, build_model, plain_model

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
    perturb(model)
    return model.eval()


def perturb(module: torch.nn.Module) -> None:
    """Every weight moved off its initial value, and every router's e_score_correction_bias made non-zero, large
    enough to change choices."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.02)
        for m in module.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.copy_(torch.randn(m.e_score_correction_bias.shape) * 0.1)


def _train(hf_dir: str, layout: dict, data: torch.Tensor, out_dir: str | None = None) -> dict | None:
    return train_from_hf(hf_dir, {"lr": LR, **layout}, data, out_dir)


LAYOUTS = {"1x1x1": {}, "tp2": dict(tp=2), "tp2 sp": dict(tp=2, sequence_parallel=True), "pp2": dict(pp=2),
           "dp2 ep2": dict(dp=2, ep=2), "cp2 tp2": dict(cp=2, tp=2),
           # ZeRO-3 with the experts over ep 2 (its edp 2 partitions them); at dp 4: DeepSpeed's barriers span the world
           "zero3 dp4 ep2": dict(dp=4, ep=2, deepspeed_config="ds_configs/zero3.json")}


# ... and where the MTP module meets data and expert parallelism (its experts over ep, its targets per dp rank's rows)
# and full recomputation (its block recomputed in the backward like the stack's)
MTP_LAYOUTS = {"1x1x1": {}, "tp2": dict(tp=2), "tp2 sp": dict(tp=2, sequence_parallel=True), "pp2": dict(pp=2),
               "cp2 tp2 sp": dict(cp=2, tp=2, sequence_parallel=True),
               "dp2 ep2 recompute": dict(dp=2, ep=2, recompute="full")}
MTP2_LAYOUTS = {"1x1x1": {}, "tp2": dict(tp=2), "cp2": dict(cp=2)}  # depth 2 (cp: each depth's shift, then the split)
MTP_COEF = 0.3  # λ, large enough for the MTP module to move the gradient norm


def _world(rank, world_size, hf_dir, data, trip_dir, trip_data, run_dir, mtp_dir, mtp_run_dir, mtp2_dir):
    runs = {label: _train(hf_dir, layout, data) for label, layout in LAYOUTS.items()}
    # the round trip: the bias learned (loss-free balancing) at dp 2 × ep 2 × tp 2, saved
    runs["trip"] = _train(trip_dir, dict(dp=2, ep=2, tp=2, moe_bias_update_rate=1e-2), trip_data, run_dir)
    runs["trip 1x1x1"] = _train(trip_dir, dict(moe_bias_update_rate=1e-2), trip_data)  # ... and in one process
    # ... and resumed from that checkpoint in one process (resharded from dp 2 × ep 2 × tp 2): the tables it restores
    runs["trip resumed"] = _train(trip_dir, dict(moe_bias_update_rate=1e-2, resume=run_dir), trip_data[:0])
    for label, layout in MTP_LAYOUTS.items():  # multi-token prediction (the one-process run saved, for the export)
        runs[f"mtp {label}"] = _train(mtp_dir, {**layout, "mtp_loss_coef": MTP_COEF}, data,
                                      mtp_run_dir if label == "1x1x1" else None)
    for label, layout in MTP2_LAYOUTS.items():  # two MTP modules: h^1 feeds depth 2
        runs[f"mtp2 {label}"] = _train(mtp2_dir, {**layout, "mtp_loss_coef": MTP_COEF}, data)
    return runs


def test_trains_like_transformers_and_exports(tmp_path, capsys):
    """A random DeepseekV3ForCausalLM trained by transformers in a plain loop and by trainer3d --init-from-hf at seven
    layouts (ZeRO-3 at dp 4 × ep 2 among them): losses and gradient norms within 1e-5 (relative) at every step. Another, trained at dp 2 × ep 2 × tp 2
    with loss-free balancing (rate 1e-2, 4 steps) equals its one-process run (losses, norms, the biases bitwise),
    saved and exported: transformers reads back the biases the
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
    hf_mtp, mtps = hf_deepseek_mtp(tmp_path / "mtp", seed=9)
    mtp_ref = mtp_reference_run(hf_mtp, mtps, batches(), MTP_COEF)
    hf_mtp2, mtps2 = hf_deepseek_mtp(tmp_path / "mtp2", seed=11, depth=2)
    unchained = mtp_reference_run(copy.deepcopy(hf_mtp2), copy.deepcopy(mtps2), batches()[:1], MTP_COEF, chain=False)
    mtp2_ref = mtp_reference_run(hf_mtp2, mtps2, batches(), MTP_COEF)
    results = run_world(4, _world, str(tmp_path / "hf"), batches(), str(tmp_path / "trip"), trip_data,
                        str(tmp_path / "run"), str(tmp_path / "mtp"), str(tmp_path / "mtp_run"),
                        str(tmp_path / "mtp2"), timeout=600)
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
    assert ours["1x1x1"]["mcfg"].mtp_layers == 0 and ours["1x1x1"]["mtp"] == [None] * len(ref_losses)
    report += _check_mtp(ours, mtp_ref, tmp_path)
    for label in MTP2_LAYOUTS:  # depth 2: λ/D over two depths, depth 2 reading depth 1's h and t_{i+2}
        run = ours[f"mtp2 {label}"]
        rel = {key: max(abs(a - b) / b for a, b in zip(run[key], values))
               for key, values in zip(("losses", "mtp", "norms"), mtp2_ref)}
        report.append(f"trainer3d MTP depth 2 {label}: loss, MTP loss, grad norm rel diff "
                      f"{rel['losses']:.1e}, {rel['mtp']:.1e}, {rel['norms']:.1e}")
        assert run["mcfg"].mtp_layers == 2 and max(rel.values()) < 1e-5, (label, run, mtp2_ref)
    # feeding h^0 to depth 2 would be caught: its MTP loss is 5x the bound above away, or more (measured 6x)
    assert abs(unchained[1][0] - mtp2_ref[1][0]) > 5 * 1e-5 * mtp2_ref[1][0], (unchained, mtp2_ref)

    restored = ours["trip resumed"]["tables"]  # a learned (nonzero) bias resumed and resharded, bitwise
    saved = next(r["trip"] for r in results if r["trip"] is not None and "path" in r["trip"])["tables"]
    assert restored.keys() == saved.keys() and all(torch.equal(restored[k], v) for k, v in saved.items())
    assert any(v.abs().max() > 0 for v in restored.values())

    run = next(r["trip"] for r in results if r["trip"] is not None and "path" in r["trip"])
    one = ours["trip 1x1x1"]  # loss-free balancing at dp 2 x ep 2 x tp 2 as in one process: every rank's loads counted
    trip_rel = max(abs(a - b) / b for a, b in zip(run["losses"] + run["norms"], one["losses"] + one["norms"]))
    report.append(f"loss-free balancing at dp2 ep2 tp2 against one process: loss and norm rel diff {trip_rel:.1e}, "
                  f"biases equal: {all(torch.equal(run['tables'][k], v) for k, v in one['tables'].items())}")
    assert trip_rel < 1e-5 and one["tables"].keys() == run["tables"].keys(), (run, one)
    assert all(torch.equal(run["tables"][k], v) for k, v in one["tables"].items()), (run["tables"], one["tables"])
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


# ---- multi-token prediction: the reference --------------------------------------------------------------------------
class PaperMTP(torch.nn.Module):
    """MTP module k as DeepSeek-V3 §2.2 writes it, of transformers' parts and nothing of trainer3d's: on the T - k
    positions whose target t_{i+k+1} exists, h'_i = eh_proj([enorm(Emb(t_{i+k})); hnorm(h^{k-1}_i)]), then a
    transformers DeepseekV3DecoderLayer (`block`, MoE) under a causal mask, then its own final norm before the model's
    head. Sequences shrink by one per depth here, where trainer3d keeps their length and pads."""

    def __init__(self, config, block: torch.nn.Module):
        super().__init__()
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

        d, eps = config.hidden_size, config.rms_norm_eps
        self.enorm, self.hnorm, self.norm = (DeepseekV3RMSNorm(d, eps) for _ in range(3))
        self.eh_proj = torch.nn.Linear(2 * d, d, bias=False)
        self.block = block

    def forward(self, h: torch.Tensor, embedded: torch.Tensor, rotary) -> tuple[torch.Tensor, torch.Tensor]:
        L = embedded.shape[1]
        h = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(h[:, :L])], dim=-1))
        positions = torch.arange(L)[None]
        mask = torch.full((L, L), float("-inf")).triu(1)[None, None]
        h = self.block(h, attention_mask=mask, position_ids=positions, position_embeddings=rotary(h, positions))
        return h, self.norm(h)


def hf_deepseek_mtp(directory, seed: int, depth: int = 1):
    """hf_deepseek(seed) with `depth` PaperMTP modules (every weight perturbed, each router's bias non-zero), saved
    in `directory` as DeepSeek's files hold them: module k as layer n_layer + k - 1 (its block's tensors as
    transformers writes a layer's, enorm, hnorm, eh_proj, shared_head.norm, and copies of the embedding and the head
    as embed_tokens and shared_head.head). Returns (the model, the modules)."""
    from safetensors.torch import load_file, save_file

    hf = hf_deepseek(seed=seed)
    n = hf.config.num_hidden_layers
    longer = copy.deepcopy(hf.config)
    longer.num_hidden_layers = n + depth
    torch.manual_seed(seed + 1)
    donor = transformers.DeepseekV3ForCausalLM(longer)  # initialized blocks n..n+depth-1, in the files' spelling
    mtps = torch.nn.ModuleList(PaperMTP(hf.config, donor.model.layers[n + k]) for k in range(depth))
    perturb(mtps)
    hf.save_pretrained(directory)
    donor.save_pretrained(directory / "donor")
    weights = load_file(directory / "model.safetensors")
    blocks = load_file(directory / "donor" / "model.safetensors")
    for k, mtp in enumerate(mtps):
        prefix = f"model.layers.{n + k}."
        weights.update({key: t for key, t in blocks.items() if key.startswith(prefix)})
        own = {"enorm.weight": mtp.enorm.weight, "hnorm.weight": mtp.hnorm.weight, "eh_proj.weight": mtp.eh_proj.weight,
               "shared_head.norm.weight": mtp.norm.weight, "embed_tokens.weight": hf.model.embed_tokens.weight,
               "shared_head.head.weight": hf.lm_head.weight}
        weights.update({prefix + key: t.detach().clone() for key, t in own.items()})
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**raw, "num_nextn_predict_layers": depth}))
    return hf, mtps


def mtp_reference_run(hf, mtps, data: torch.Tensor, coef: float,
                      chain: bool = True) -> tuple[list[float], list[float], list[float]]:
    """transformers' model and the PaperMTP modules trained in a plain loop (torch's AdamW, tests/helpers/reference.py's
    schedule and decay rule) on loss + coef/D·Σ_k L_k, L_k depth k's mean cross-entropy; h^0 is the last decoder
    layer's output (before the final norm), h^k module k's output, which module k + 1 reads (`chain=False`: every
    module reads h^0, a mistake the tests must catch). Returns per step the main loss, the mean of the L_k and the
    gradient norm before clipping."""
    both = torch.nn.ModuleList([hf, mtps]).train()
    opt = adamw(both, LR, OPTIM["weight_decay"])
    last: dict = {}
    hook = hf.model.layers[-1].register_forward_hook(lambda module, args, out: last.update(h=out))
    losses, mtp_losses, norms = [], [], []
    for step, batch in enumerate(data):
        T = batch.shape[1] - 1
        logits = hf(batch[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        h, depths = last["h"], []
        for k, mtp in enumerate(mtps, 1):
            prior = h if chain else last["h"]
            h, normed = mtp(prior, hf.model.embed_tokens(batch[:, k:T]), hf.model.rotary_emb)
            depths.append(F.cross_entropy(hf.lm_head(normed).flatten(0, 1), batch[:, k + 1:].flatten()))
        mtp_loss = sum(depths) / len(depths)
        (loss + coef * mtp_loss).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(both.parameters(), OPTIM["grad_clip"]).item())
        for group in opt.param_groups:
            group["lr"] = lr_schedule(step, LR, OPTIM["warmup_steps"], OPTIM["max_steps"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        mtp_losses.append(mtp_loss.item())
    hook.remove()
    return losses, mtp_losses, norms


def _check_mtp(ours: dict, ref: tuple, tmp_path) -> list[str]:
    """The MTP runs against the reference (the main loss, the MTP loss and the gradient norm within 1e-5, relative,
    at every step), and the one-process run's export: DeepSeek's names and num_nextn_predict_layers, read back by
    trainer3d as saved, loaded by transformers (which ignores the MTP layer) with trainer3d's logits."""
    from safetensors import safe_open

    from trainer3d.checkpoint.format import Checkpoint
    from trainer3d.checkpoint.hf import load_hf_checkpoint
    from trainer3d.export import main as export_main

    ref_losses, ref_mtp, ref_norms = ref
    report = [f"transformers + the paper's MTP module: losses {[f'{x:.6f}' for x in ref_losses]}, MTP losses "
              f"{[f'{x:.6f}' for x in ref_mtp]}"]
    for label in MTP_LAYOUTS:
        run = ours[f"mtp {label}"]
        rel = {key: max(abs(a - b) / b for a, b in zip(run[key], values))
               for key, values in (("losses", ref_losses), ("mtp", ref_mtp), ("norms", ref_norms))}
        report.append(f"trainer3d MTP {label}: loss rel diff {rel['losses']:.1e}, MTP loss rel diff {rel['mtp']:.1e}, "
                      f"grad norm rel diff {rel['norms']:.1e}")
        assert run["mcfg"].mtp_layers == 1 and max(rel.values()) < 1e-5, (label, run, ref)
    assert ref_mtp[-1] < ref_mtp[0] - 0.05  # the module learns

    export = tmp_path / "mtp_export"
    assert export_main([ours["mtp 1x1x1"]["path"], str(export), "--tokenizer", "none"]) == 0
    with safe_open(str(export / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    parts = ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head", "embed_tokens", "self_attn.kv_b_proj",
             "mlp.experts.7.down_proj", "mlp.shared_experts.up_proj")
    assert {f"model.layers.4.{p}.weight" for p in parts} | {"model.layers.4.mlp.gate.e_score_correction_bias"} <= names
    assert json.loads((export / "config.json").read_text())["num_nextn_predict_layers"] == 1
    ckpt = Checkpoint(ours["mtp 1x1x1"]["path"])
    cfg, state = load_hf_checkpoint(export)
    saved = {**ckpt.model_state(), **ckpt.model_tables()}
    assert cfg == ckpt.model_config and set(state) == set(saved)
    assert all(torch.equal(state[k], saved[k].float()) for k in saved)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    x = batches(1)[0, :2, :-1]
    with torch.no_grad():
        diff = (plain_model(cfg, state, torch.device("cpu"), torch.float32)(x) - theirs(x).logits).abs().max().item()
    report.append(f"MTP export: read back as saved; transformers' logits diff {diff:.1e}")
    assert diff < 1e-5
    return report


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
    The published counts leave out the MTP modules that num_params counts, where the preset has them (DeepSeek-V3's
    one: mtp_params 11.6B; the paper's 14B counts the module's copies of the embedding and head, 1.9B). The model built
    on the meta device holds num_params, and its tp 2 shards add up to it."""
    from trainer3d.models.deepseek_v3.hf import DeepseekV3Adapter
    from trainer3d.parallel.param_counts import local_params

    cfg = MODEL_PRESETS[name]
    assert DeepseekV3Adapter().config_from_hf(PUBLISHED[name]) == cfg
    activated = cfg.num_params(active=True) - cfg.mtp_params(active=True) - cfg.vocab_size * cfg.n_embd
    assert (cfg.num_params() - cfg.mtp_params()) / 1e9 == pytest.approx(total, rel=rel)
    assert round(activated / 1e9) == active
    small = dataclasses.replace(cfg, n_layer=cfg.first_k_dense_replace + 1)  # the dense blocks and one MoE block
    with torch.device("meta"):
        built = build_model(small)
    assert sum(p.numel() for p in built.parameters()) == small.num_params()
    assert cfg.mtp_layers == (name == "deepseek-v3") and round(cfg.mtp_params() / 1e8) == 116 * cfg.mtp_layers
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
    """Multi-token prediction as far as the files hold it: transformers' own save declares an MTP layer and holds no
    weights of it, so it loads without one, with a note, as transformers loads it, and exports declaring none; a
    directory holding the module (DeepSeek's layout) keeps it, unless the run builds none (--mtp-loss-coef 0).
    Quantized files, another router score or rope type are refused with the reason; Kimi K2's `kimi_k2` directories
    read as DeepSeek-V3. A config's every field survives the export's config.json."""
    from trainer3d.checkpoint.hf import HFDirectory, load_hf_checkpoint
    from trainer3d.models.deepseek_v3.hf import DeepseekV3Adapter

    _saved(tmp_path / "mtp")
    directory = HFDirectory(tmp_path / "mtp")
    directory.check()
    assert len(directory.notes) == 1 and "declares 1 multi-token-prediction layer" in directory.notes[0]
    cfg, state = load_hf_checkpoint(tmp_path / "mtp")
    assert cfg.mtp_layers == 0
    theirs = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "mtp").eval()
    x = batches(1)[0, :2, :-1]
    with torch.no_grad():
        assert (plain_model(cfg, state, torch.device("cpu"), torch.float32)(x) - theirs(x).logits).abs().max() < 1e-5
    hf_deepseek_mtp(tmp_path / "with", seed=1)
    held, skipped = HFDirectory(tmp_path / "with"), HFDirectory(tmp_path / "with", mtp_layers=0)
    held.check()
    skipped.check()
    assert held.cfg.mtp_layers == 1 and not held.notes and skipped.cfg == cfg
    adapter = DeepseekV3Adapter()
    exported = adapter.hf_config(cfg).to_dict()
    assert exported["num_nextn_predict_layers"] == 0 and exported["num_key_value_heads"] == cfg.n_head
    assert adapter.config_from_hf(exported) == cfg
    assert adapter.config_from_hf(adapter.hf_config(held.cfg).to_dict()) == held.cfg
    for preset in ("deepseek-v3", "kimi-k2", "moonlight-16b-a3b", "deepseek-v3-tiny"):
        assert adapter.config_from_hf(adapter.hf_config(MODEL_PRESETS[preset]).to_dict()) == MODEL_PRESETS[preset]

    raw = json.loads((tmp_path / "mtp" / "config.json").read_text())
    for change, reason in (({"quantization_config": {"quant_method": "fp8"}}, "dequantize them to bf16 first, and "
                            "where they already are, delete the \"quantization_config\" entry from config.json"),
                           ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
                           ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "rope_type='llama3'")):
        with pytest.raises(ValueError, match=reason):
            adapter.config_from_hf({**raw, **change})
    assert adapter.config_from_hf({**raw, "model_type": "kimi_k2"}) == dataclasses.replace(cfg, mtp_layers=1)


def test_the_tiny_preset_trains_from_the_command_line(tmp_path):
    """`--model deepseek-v3-tiny` (trimmed to one dense and one MoE block, with its MTP module) trains from the entry
    script, metrics.jsonl logging the MTP loss apart."""
    import subprocess
    import sys
    from pathlib import Path

    from helpers.distributed import launch_env

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, str(root / "launch" / "train.py"), "--model", "deepseek-v3-tiny", "--n-layer", "3",
           "--seq-len", "32", "--global-batch", "2", "--max-steps", "2", "--eval-every", "0", "--no-final-save",
           "--out-dir", str(tmp_path / "run")]
    p = subprocess.run(cmd, env=launch_env(), capture_output=True, text=True, timeout=300, cwd=str(root))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "model=deepseek-v3-tiny (deepseek_v3, " in p.stdout and "trained steps 1-2" in p.stdout, p.stdout[-2000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 2 and all(abs(r["mtp_loss"] - r["loss"]) < 1 for r in steps), steps  # (both ~ln V at first)


def test_mtp_targets_keep_the_mask_and_the_documents():
    """Depth k's target at position i is t_{i+k+1}: the targets shifted by k, unsupervised past the row's end, where
    the labels mask them, and where t_{i+k} lies in another document than t_i (a document opens at t_3 here)."""
    from trainer3d.parallel.mtp import shifted_targets

    targets = torch.tensor([[1, 2, 3, -1, 5, 6]])  # t_1..t_6, t_4 unsupervised
    documents = torch.tensor([[0, 0, 0, 1, 1, 1, 1]])  # t_0..t_6
    assert shifted_targets(targets, 2, documents).tolist() == [[2, 3, -1, 5, 6, -1, 3, -1, -1, 6, -1, -1]]
    assert shifted_targets(targets, 2).tolist() == [[2, 3, -1, 5, 6, -1, 3, -1, 5, 6, -1, -1]]


def test_mtp_flags_are_refused_before_any_process_group(monkeypatch, capsys):
    """Guards: an MTP weight for a family without MTP modules (or a model built without them) and a negative one are
    one sentence and exit 2, before any process group (a rank launched alone would hang in init_process_group)."""
    from trainer3d.train.loop import main

    launched_alone(monkeypatch, 2)
    tiny = ["--model", "deepseek-v3-tiny"]
    for flags, says in (
            (["--mtp-loss-coef", "0.1"], "--mtp-loss-coef 0.1 weighs the loss of multi-token prediction modules, and "
                                         "the gpt2 family has none; drop it."),
            (tiny + ["--mtp-loss-coef", "-1"], "--mtp-loss-coef must be at least 0.0 (got -1.0)."),
            (tiny + ["--mtp-layers", "0", "--mtp-loss-coef", "0.3"], "and this model has none")):
        assert main(BASE + flags) == 2, flags
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err and says in err, err


def test_decoding_caches_the_latent_and_equals_the_whole_forward():
    """Guards: the KV cache of MLA holds the normed kv latent and the rotated rope key (kv_lora_rank and
    qk_rope_head_dim wide, one "head"), not k and v; a prefill then token-by-token decoding gives the logits of the
    whole sequence's forward at every position."""
    from trainer3d.models.attention import KVCache

    cfg = dataclasses.replace(MODEL_PRESETS["deepseek-v3-tiny"], vocab_size=96, n_positions=64, mtp_layers=0)
    torch.manual_seed(0)
    model = build_model(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    model.init_tables(torch.device("cpu"))
    model.eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    with torch.no_grad():
        whole = model(ids)
        cache = KVCache(max_len=12)
        steps = [model(ids[:, :5], cache)] + [model(ids[:, t:t + 1], cache) for t in range(5, 12)]
    assert cache.length == 12 and set(cache.k) == set(range(cfg.n_layer))
    assert cache.k[0].shape == (2, 1, 12, cfg.kv_lora_rank) and cache.v[0].shape == (2, 1, 12, cfg.qk_rope_head_dim)
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=1e-5, atol=1e-5)


FP8_BLOCK = (16, 24)  # DeepSeek publishes 128 x 128; smaller, non-square blocks cut the tiny model's weights unevenly


def _fp8_copy(src, dst, ref):
    """`src` (a save_pretrained directory) as DeepSeek publishes FP8 weights, written here from the published rule:
    every 2-D linear weight but the embedding, the head and the routers as float8_e4m3fn Q with a `_scale_inv` S per
    block (the block's absolute max / 448, e4m3's largest), so that W ≈ Q·S blockwise, and config.json's
    quantization_config. `ref` gets the weights those files stand for, dequantized block by block by a loop here, in a
    directory without quantization."""
    import math
    import shutil

    from safetensors.torch import load_file, save_file

    state = load_file(str(src / "model.safetensors"))
    quantized, plain = {}, {}
    for name, w in state.items():
        skip = ("embed_tokens", "lm_head", "mlp.gate.weight", "norm")
        if w.dim() != 2 or not name.endswith(".weight") or any(s in name for s in skip):
            quantized[name] = plain[name] = w
            continue
        (R, C), (br, bc) = w.shape, FP8_BLOCK
        scales = torch.empty(math.ceil(R / br), math.ceil(C / bc))
        q = torch.empty(R, C, dtype=torch.float8_e4m3fn)
        dequantized = torch.empty(R, C)
        for i in range(scales.shape[0]):
            for j in range(scales.shape[1]):
                rows, cols = slice(i * br, (i + 1) * br), slice(j * bc, (j + 1) * bc)
                scales[i, j] = w[rows, cols].abs().max() / 448.0
                q[rows, cols] = (w[rows, cols] / scales[i, j]).to(torch.float8_e4m3fn)
                dequantized[rows, cols] = q[rows, cols].float() * scales[i, j]
        quantized[name], quantized[name + "_scale_inv"], plain[name] = q, scales, dequantized
    for directory, tensors in ((dst, quantized), (ref, plain)):
        directory.mkdir()
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        shutil.copy(src / "generation_config.json", directory) if (src / "generation_config.json").exists() else None
    config = json.loads((src / "config.json").read_text())
    (ref / "config.json").write_text(json.dumps(config))
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": list(FP8_BLOCK)}
    (dst / "config.json").write_text(json.dumps(config))
    return sum(1 for n in quantized if n.endswith("_scale_inv"))


def test_fp8_block_scaled_weights_are_read_as_the_values_they_stand_for(tmp_path):
    """DeepSeek's published FP8 layout (a random model saved so): --init-from-hf reads each quantized weight as Q·S
    blockwise, equal to the test's own dequantization, whole and in every tp rank's rows or columns at tp 2 and 3
    (across block edges); the model's logits are transformers' on the dequantized weights; the run's
    notes say so; scales of the wrong shape are refused (before, every such directory was refused)."""
    from trainer3d.checkpoint.hf import HFDirectory, load_hf_checkpoint
    from trainer3d.models import canonical_shapes
    from trainer3d.parallel.tensor_parallel import TPSpec

    hf = hf_deepseek(seed=4)
    hf.save_pretrained(tmp_path / "src")
    n = _fp8_copy(tmp_path / "src", tmp_path / "fp8", tmp_path / "ref")
    assert n >= 20  # attention, dense MLPs, experts and shared experts
    d = HFDirectory(tmp_path / "fp8")
    d.check()
    assert any("FP8 weights with 16x24 block scales, dequantized as they are read" in note for note in d.notes)
    ref = HFDirectory(tmp_path / "ref")
    for name in ref.index:
        assert torch.equal(d.hf_tensor(name).float(), ref.hf_tensor(name).float()), name
    g = torch.Generator().manual_seed(0)
    for name, shape in canonical_shapes(d.cfg).items():  # every tp rank's rows or columns, across block edges
        for dim in range(len(shape)):
            for tp in (2, 3):
                if shape[dim] % tp:
                    continue
                spec = TPSpec(dim=dim, full_shape=tuple(shape))
                local = tuple(n // tp if i == dim else n for i, n in enumerate(shape))
                for rank in range(tp):
                    assert torch.equal(d.shard(name, spec, local, rank, tp), ref.shard(name, spec, local, rank, tp)), \
                        (name, dim, tp, rank)
    cfg, state = load_hf_checkpoint(tmp_path / "fp8")
    ours = plain_model(cfg, state, torch.device("cpu"), torch.float32)
    reference = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "ref").eval()
    x = torch.randint(0, VOCAB, (2, 24), generator=g)
    with torch.no_grad():
        assert (ours(x) - reference(x).logits).abs().max() < 2e-5
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [16, 16]
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="block scales .* fit no weight of the config"):
        HFDirectory(tmp_path / "fp8").check()
