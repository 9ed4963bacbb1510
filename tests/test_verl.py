"""trainer3d as verl's training backend, driven through verl's own interfaces: EngineRegistry.new(backend="trainer3d")
builds it from verl's HFModelConfig and optimizer config; verl's DataProto -> TensorDict -> left_right_2_no_padding
gives its padding-free batches (prompts left-padded, responses right-padded and of mixed lengths); verl's ppo_loss
(vanilla clip, dual clip, an entropy bonus, at a rollout temperature) trains it through train_batch, under token-mean
and then seq-mean-token-mean, with the old log-probs from infer_batch (moved by noise, so that the clip acts). At
tp2·pp2, dp2·tp2 and ZeRO-1 dp4, each step's loss and gradient norm (as verl's worker reports them) equal
trainer3d.engine driven directly at one process on the same sequences, with the PPO loss written here from its
definition (Schulman et al. 2017; dual clip: Ye et al. 2020) and the engine's token-mean / sequence-mean; so does a
Qwen3-MoE at tp2·ep2·dp2 (its balance loss in both); the log-probs infer_batch returns equal the engine's;
get_per_tensor_param streams transformers' names (per expert) with the trained weights. verl's sft_loss (its SFT
trainer's) at tp2·dp2 equals its definition through trainer3d.engine at one process. The reference side imports nothing of the adapter."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import transformers

from helpers.distributed import run_world
from helpers.parity import PARAM_ATOL
from test_llama import hf_llama
from test_llama_hf import hf_moe
from trainer3d.config import TrainConfig
from helpers.verl_site import verl_site

B, PROMPT, RESPONSE, SEQ = 8, 10, 14, 32  # rollouts; longest prompt and response; rows of SEQ + 1 tokens
LR, BETAS, CLIP, TEMPERATURE, ENTROPY_COEFF = 2e-3, (0.9, 0.999), 1.0, 0.8, 0.5
EPS_LOW, EPS_HIGH, DUAL_CLIP = 0.2, 0.28, 3.0
AGGREGATIONS = [("token-mean", "token-mean"), ("seq-mean-token-mean", "sequence-mean"), ("token-mean", "token-mean")]


def rollouts(seed: int):
    """Left-padded prompts and right-padded responses of mixed lengths (verl's rollout layout), per-sequence
    advantages (GRPO's: one a sequence, spread over its tokens), and noise for the old log-probs."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(3, PROMPT + 1, (B,), generator=g)
    response_lens = torch.randint(2, RESPONSE + 1, (B,), generator=g)
    ids = torch.randint(0, 1000, (B, PROMPT + RESPONSE), generator=g)
    positions = torch.arange(PROMPT + RESPONSE)
    attention = ((positions >= PROMPT - prompt_lens[:, None]) & (positions < PROMPT + response_lens[:, None])).long()
    advantages = torch.randn(B, 1, generator=g).expand(B, RESPONSE).contiguous()
    noise = 0.6 * torch.randn(B, RESPONSE, generator=g)  # wide enough that both clips act (ratios past 1 + ε, and past
    # the dual clip's 3 for negative advantages)
    return ids, attention, advantages, noise


def sequences(ids, attention):
    """Each rollout's real tokens, and its response's first position among them."""
    return ([row[mask.bool()] for row, mask in zip(ids, attention)],
            [int(mask[:PROMPT].sum()) for mask in attention])


def ppo_token_loss(logprobs, fields):
    """PPO's clipped surrogate per token, dual-clipped for negative advantages, minus the entropy bonus."""
    ratio = torch.exp(logprobs - fields["old"])
    adv = fields["adv"]
    clipped = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - EPS_LOW, 1 + EPS_HIGH))
    dual = torch.minimum(-adv * DUAL_CLIP, clipped)
    return torch.where(adv < 0, dual, clipped) - ENTROPY_COEFF * fields["entropy"]


def reference(hf_dir, data, tmp):
    """trainer3d.engine at one process: per step, the old log-probs at the rollout temperature (+ noise), then the
    PPO loss over the responses' tokens under the step's aggregation."""
    from trainer3d.engine import Engine

    cfg = TrainConfig(init_from_hf=hf_dir, seq_len=SEQ, global_batch=4, precision="fp32", lr=LR, beta1=BETAS[0],
                      beta2=BETAS[1], warmup_steps=0,
                      min_lr=LR, max_steps=100, grad_clip=CLIP, weight_decay=0.0, document_mask=True,
                      reset_position_ids=True, out_dir=tmp)
    engine = Engine(cfg, ranks=[0])
    out = None
    if engine.active:
        out = {"losses": [], "norms": []}
        for step, (_, aggregation) in enumerate(AGGREGATIONS):
            ids, attention, advantages, noise = data[step]
            seqs, starts = sequences(ids, attention)
            lens = attention[:, PROMPT:].sum(1).tolist()
            old = engine.logprobs(seqs, temperature=TEMPERATURE)
            if step == 0:
                out["logprobs"] = [lp[s - 1:s - 1 + n] for lp, s, n in zip(old, starts, lens)]
            masks, olds, advs = [], [], []
            for lp, s, n, eps, adv in zip(old, starts, lens, noise, advantages):
                where = torch.zeros(len(lp), dtype=torch.bool)
                where[s - 1:s - 1 + n] = True  # position t scores token t + 1: the response's tokens
                moved, per_token = lp.clone(), torch.zeros(len(lp))
                moved[where], per_token[where] = lp[where] + eps[:n], adv[:n]
                masks.append(where), olds.append(moved), advs.append(per_token)
            out["losses"].append(engine.forward_backward(
                seqs, ppo_token_loss, mask=masks, fields={"old": olds, "adv": advs}, aggregation=aggregation,
                temperature=TEMPERATURE, entropy=True))
            out["norms"].append(engine.step()["grad_norm"])
        out["weights"] = dict(engine.named_weights())
    engine.close()
    return out


def through_verl(hf_dir, args, offload, data, tmp):
    """The same steps as verl's worker runs them: infer_batch for the old log-probs, train_batch with verl's ppo_loss,
    the loss summed over micro-batches and averaged over dp, the norm from optimizer_step."""
    from functools import partial

    import torch.distributed as dist
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import ActorConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    found = EngineRegistry.get_engine_cls("language_model", "trainer3d")  # before trainer3d imports anything of verl

    from trainer3d.engine.verl_engine import Trainer3dEngine, Trainer3dEngineConfig

    assert found is Trainer3dEngine  # the class verl's registry found through the plugin entry point, on `import verl`
    # the engine config as verl's hydra config builds it (`actor_rollout_ref.actor.engine._target_=...`)
    engine_config = omega_conf_to_dataclass(OmegaConf.create({
        "_target_": "trainer3d.engine.verl_engine.Trainer3dEngineConfig", "dtype": "float32",
        "args": [*args, "--seq-len", str(SEQ), "--global-batch", "4", "--precision", "fp32", "--out-dir", tmp],
        "max_token_len_per_gpu": 48, "param_offload": offload, "optimizer_offload": offload}))
    assert isinstance(engine_config, Trainer3dEngineConfig), type(engine_config)
    engine = EngineRegistry.new(
        model_type="language_model", backend="trainer3d",
        model_config=HFModelConfig(path=hf_dir, load_tokenizer=False),
        engine_config=engine_config,
        optimizer_config=FSDPOptimizerConfig(lr=LR, betas=BETAS, weight_decay=0.0, clip_grad=CLIP,
                                             total_training_steps=10))
    engine.initialize()
    dp, rank = engine.get_data_parallel_size(), engine.get_data_parallel_rank()
    out = {"losses": [], "norms": [], "clipfrac": [], "dp": dp, "dp_rank": rank,
           "collects": engine.is_mp_src_rank_with_outputs()}
    for step, (agg, _) in enumerate(AGGREGATIONS):
        ids, attention, advantages, noise = (x[rank * B // dp:(rank + 1) * B // dp] for x in data[step])
        batch = {"input_ids": ids, "prompts": ids[:, :PROMPT], "attention_mask": attention, "responses": ids[:, PROMPT:],
                 "response_mask": attention[:, PROMPT:], "position_ids": (attention.cumsum(-1) - 1).clamp(min=0)}
        proto = DataProto.from_single_dict(batch, meta_info={"temperature": TEMPERATURE})
        td = left_right_2_no_padding(proto.to_tensordict())
        tu.assign_non_tensor(td, use_dynamic_bsz=True, max_token_len_per_gpu=48)
        with engine.eval_mode():
            old = no_padding_2_padding(engine.infer_batch(td)["model_output"]["log_probs"], td)
        if step == 0:
            out["logprobs"] = old
        proto.batch["old_log_probs"] = old + noise
        proto.batch["advantages"] = advantages
        td = left_right_2_no_padding(proto.to_tensordict())
        tu.assign_non_tensor(td, use_dynamic_bsz=True, max_token_len_per_gpu=48, calculate_entropy=True,
                             global_batch_size=B)
        config = ActorConfig(strategy="trainer3d", rollout_n=1, ppo_micro_batch_size_per_gpu=-1, loss_agg_mode=agg,
                             clip_ratio_low=EPS_LOW, clip_ratio_high=EPS_HIGH, clip_ratio_c=DUAL_CLIP,
                             entropy_coeff=ENTROPY_COEFF)
        with engine.train_mode():
            result = engine.train_batch(td, partial(ppo_loss, config=config))
        out["offloaded"] = engine.engine.offloaded is not None  # between verl's calls, under param_offload
        loss = torch.tensor(sum(result["loss"]), dtype=torch.float64)
        dist.all_reduce(loss, group=engine.get_data_parallel_group())  # verl's worker: the mean over dp
        out["losses"].append(float(loss) / dp)
        out["norms"].append(result["metrics"].get("grad_norm"))  # verl's train_batch: on the ranks that collect
        out["clipfrac"].append((sum(result["metrics"]["actor/pg_clipfrac"].values),
                                sum(result["metrics"]["actor/pg_clipfrac_lower"].values)))
        engine.lr_scheduler_step()
    out["weights"] = dict(engine.get_per_tensor_param()[0])
    engine.engine.close()
    return out


def sft_sequences():
    """Four SFT samples in verl's padding-free layout: tokens, and a loss mask over the inputs (0 on a 3-token
    prompt), as verl's SFT datasets give them."""
    g = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, 1000, (n,), generator=g) for n in (9, 14, 6, 11)]
    return seqs, [(torch.arange(len(s)) >= 3).long() for s in seqs]


LORA = dict(lora_rank=4, lora_alpha=8.0, lora_targets="q_proj,v_proj")  # (verl's model config: LORA_VERL)
LORA_VERL = dict(lora_rank=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


def sft_direct(hf_dir, tmp, lora: bool = False):
    """verl's sft_loss by its definition (the mean over the batch's masked tokens of -log p, the mask of the token
    predicted), through trainer3d.engine at one process: (loss, norm), and with `lora` (LoRA) the weights after the
    step, merged and the adapters alone."""
    from trainer3d.engine import Engine

    cfg = TrainConfig(init_from_hf=hf_dir, seq_len=SEQ, global_batch=4, precision="fp32", lr=LR, beta1=BETAS[0],
                      beta2=BETAS[1], warmup_steps=0, min_lr=LR, grad_clip=CLIP, weight_decay=0.0,
                      document_mask=True, reset_position_ids=True, out_dir=tmp, **(LORA if lora else {}))
    engine, out = Engine(cfg, ranks=[0]), None
    if engine.active:
        seqs, masks = sft_sequences()
        loss = engine.forward_backward(seqs, lambda lp, f: -lp, mask=[m[1:].bool() for m in masks])
        out = (loss, engine.step()["grad_norm"])
        if lora:
            out += (dict(engine.named_weights()), dict(engine.named_weights(adapters=True)))
    engine.close()
    return out


def sft_through_verl(hf_dir, args, tmp, lora: bool = False):
    """One train_batch with verl's own sft_loss on the same samples (loss summed over micro-batches, mean over dp;
    the norm where verl collects it). With `lora`, verl's LoRA model config (LORA_VERL), and then the weight syncs
    verl's worker asks for: the base alone (base_sync_done False), the adapters with their config, merged; and verl's
    log-probs of this rank's sequences (its compute_log_prob: infer_batch in eval mode) under disable_adapter (its
    reference policy when the actor holds it) and without, each [len] (position t scores token t + 1)."""
    from functools import partial

    import torch.distributed as dist
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import ActorConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry
    from verl.workers.utils.losses import sft_loss

    from trainer3d.engine.verl_engine import Trainer3dEngineConfig

    engine = EngineRegistry.new(
        model_type="language_model", backend="trainer3d",
        model_config=HFModelConfig(path=hf_dir, load_tokenizer=False, **(LORA_VERL if lora else {})),
        engine_config=Trainer3dEngineConfig(args=[*args, "--seq-len", str(SEQ), "--global-batch", "4", "--precision",
                                                  "fp32", "--out-dir", tmp], dtype="float32",
                                            seed=TrainConfig().seed),  # (LoRA's A is drawn from the seed)
        optimizer_config=FSDPOptimizerConfig(lr=LR, betas=BETAS, weight_decay=0.0, clip_grad=CLIP,
                                             total_training_steps=10))
    seqs, masks = sft_sequences()
    dp, rank = engine.get_data_parallel_size(), engine.get_data_parallel_rank()
    part = slice(rank * len(seqs) // dp, (rank + 1) * len(seqs) // dp)
    nested = lambda xs: torch.nested.as_nested_tensor(xs, layout=torch.jagged)  # noqa: E731
    td = tu.get_tensordict({"input_ids": nested(seqs[part]), "loss_mask": nested(masks[part]),
                            "position_ids": nested([torch.arange(len(x)) for x in seqs[part]])},
                           non_tensor_dict={"temperature": 1.0, "use_dynamic_bsz": True, "max_token_len_per_gpu": 32})
    config = ActorConfig(strategy="trainer3d", rollout_n=1, ppo_micro_batch_size_per_gpu=-1)
    with engine.train_mode():
        result = engine.train_batch(td, partial(sft_loss, config=config))
    loss = torch.tensor(sum(result["loss"]), dtype=torch.float64)
    dist.all_reduce(loss, group=engine.get_data_parallel_group())
    out = (float(loss) / dp, result["metrics"].get("grad_norm"))
    if lora:
        base, no_config = engine.get_per_tensor_param(base_sync_done=False)
        out += (dict(base), no_config is not None)
        adapters, peft_config = engine.get_per_tensor_param(base_sync_done=True)
        out += (dict(adapters), peft_config)
        engine.model_config.lora["merge"] = True  # (verl's peft_merge)
        merged, none = engine.get_per_tensor_param(base_sync_done=True)
        out += (dict(merged), none)
        scored = lambda: tu.get_tensordict(  # noqa: E731
            {"input_ids": nested(seqs[part]), "position_ids": nested([torch.arange(len(x)) for x in seqs[part]])},
            non_tensor_dict={"temperature": 1.0, "use_dynamic_bsz": True, "max_token_len_per_gpu": 32})
        with engine.eval_mode():
            with engine.disable_adapter():
                reference = engine.infer_batch(scored())["model_output"]["log_probs"].unbind()
            policy = engine.infer_batch(scored())["model_output"]["log_probs"].unbind()
        out += (list(range(len(seqs))[part]), [r.clone() for r in reference], [p.clone() for p in policy])
    engine.engine.close()
    return out


def refusals(hf_dir) -> list[str]:
    """Configs the backend refuses before building anything (no collective runs): each one sentence."""
    from verl.workers.config import FSDPOptimizerConfig, HFModelConfig

    from trainer3d.engine.verl_engine import Trainer3dEngine, Trainer3dEngineConfig
    from trainer3d.errors import ConfigError

    model = HFModelConfig(path=hf_dir, load_tokenizer=False)
    cases = [(Trainer3dEngineConfig(args=["--lr", "1e-5"]), FSDPOptimizerConfig(lr=LR)),
             (Trainer3dEngineConfig(param_offload=True), FSDPOptimizerConfig(lr=LR)),  # (without the optimizer's)
             (Trainer3dEngineConfig(args=["--dropout", "0.1"]), FSDPOptimizerConfig(lr=LR)),
             (Trainer3dEngineConfig(), FSDPOptimizerConfig(lr=LR, optimizer="AdamW8bit")),
             (Trainer3dEngineConfig(args=["--lora-rank", "8"]), FSDPOptimizerConfig(lr=LR))]
    lora_cases = [dict(lora_rank=4, exclude_modules="o_proj"), dict(lora_rank=4, target_parameters=["gate.weight"])]
    said = []
    for model_config, (engine_config, optimizer_config) in [(model, c) for c in cases] + [
            (HFModelConfig(path=hf_dir, load_tokenizer=False, **kw), (Trainer3dEngineConfig(), FSDPOptimizerConfig(
                lr=LR))) for kw in lora_cases]:
        try:
            Trainer3dEngine(model_config, engine_config, optimizer_config)
            said.append("accepted")
        except ConfigError as e:
            said.append(str(e))
    return said


def _world(rank, world_size, models, data, runs, site, tmp):
    # first, so that verl's pins win where the environment has another version (hydra's antlr4 4.9); the folder holds
    # only the packages of verl_requirements.txt (--no-deps): never torch or transformers, already imported anyway
    sys.path.insert(0, site)
    out = {f"reference {name}": reference(path, data, f"{tmp}/reference_{name}") for name, path in models.items()}
    out["refusals"] = refusals(models["llama"])
    out["sft reference"] = sft_direct(models["llama"], f"{tmp}/sft_reference")
    out["sft tp2 dp2"] = sft_through_verl(models["llama"], ["--tp", "2"], f"{tmp}/sft_tp2_dp2")
    out["lora sft reference"] = sft_direct(models["llama"], f"{tmp}/lora_sft_reference", lora=True)
    out["lora sft tp2 dp2"] = sft_through_verl(models["llama"], ["--tp", "2"], f"{tmp}/lora_sft_tp2_dp2", lora=True)
    for label, (model, args, offload) in runs.items():
        out[label] = through_verl(models[model], args, offload, data, f"{tmp}/{label.replace(' ', '_')}")
    return out


def test_verl_backend_equals_the_engine(tmp_path):
    site = verl_site()
    hf_llama(seed=5).save_pretrained(tmp_path / "llama")
    hf_moe("qwen3", seed=5).save_pretrained(tmp_path / "moe")
    models = {"llama": str(tmp_path / "llama"), "moe": str(tmp_path / "moe")}
    data = [rollouts(seed) for seed in range(len(AGGREGATIONS))]
    # (ZeRO-1 offloaded between calls as verl's contexts do under param_offload: DeepSpeed releases its parameters;
    # the Qwen3-MoE's experts split over ep, streamed under HF's per-expert names)
    runs = {"tp2 pp2": ("llama", ["--tp", "2", "--pp", "2"], False), "dp2 tp2": ("llama", ["--tp", "2"], False),
            "zero1 dp4 offload": ("llama", ["--deepspeed_config", "ds_configs/zero1.json"], True),
            "moe dp2 ep2 tp2": ("moe", ["--tp", "2", "--ep", "2"], False)}
    every_rank = run_world(4, _world, models, data, runs, site, str(tmp_path / "runs"), timeout=900)
    attention = data[0][1]
    for label, (model, _, _) in runs.items():
        ref = every_rank[0][f"reference {model}"]
        expected = torch.zeros(B, RESPONSE)
        for i, lp in enumerate(ref["logprobs"]):
            expected[i, :len(lp)] = lp
        for rank, result in enumerate(every_rank):
            run = result[label]
            rows = slice(run["dp_rank"] * B // run["dp"], (run["dp_rank"] + 1) * B // run["dp"])
            mask = attention[rows, PROMPT:].bool()
            assert (run["logprobs"][mask] - expected[rows][mask]).abs().max() < 1e-5, (label, rank)
            for step in range(len(AGGREGATIONS)):
                assert abs(run["losses"][step] - ref["losses"][step]) < 1e-5, (label, rank, run["losses"], ref["losses"])
                if run["collects"]:
                    assert abs(run["norms"][step] - ref["norms"][step]) < 1e-5 * max(1.0, ref["norms"][step]), \
                        (label, rank, step, run["norms"], ref["norms"])
            assert run["offloaded"] == ("offload" in label)
            assert list(run["weights"]) == list(ref["weights"])
            worst = max((run["weights"][k] - v).abs().max().item() for k, v in ref["weights"].items())
            assert worst < PARAM_ATOL, (label, rank, worst)  # the parity rule's bound (tests/helpers/parity.py)
        assert sorted(r[label]["dp_rank"] for r in every_rank if r[label]["collects"]) == list(range(run["dp"]))
    refs = {label: every_rank[0][f"reference {model}"] for label, (model, _, _) in runs.items()}
    print("verl backend vs engine: loss", max(abs(a - b) for r in every_rank for label in runs
                                              for a, b in zip(r[label]["losses"], refs[label]["losses"])),
          "norm (relative)", max(abs(a - b) / b for r in every_rank for label in runs if r[label]["collects"]
                                 for a, b in zip(r[label]["norms"], refs[label]["norms"])),
          "clipfrac", every_rank[0]["tp2 pp2"]["clipfrac"])
    loss, norm = every_rank[0]["sft reference"]  # verl's sft_loss (its SFT trainer's) at tp2·dp2 = the definition
    for rank, result in enumerate(every_rank):
        got_loss, got_norm = result["sft tp2 dp2"]
        assert abs(got_loss - loss) < 1e-5 * loss and (got_norm is None or abs(got_norm - norm) < 1e-5 * norm), \
            (rank, result["sft tp2 dp2"], (loss, norm))
    assert sum(r["sft tp2 dp2"][1] is not None for r in every_rank) == 2  # dp 2: one rank of each collects
    lora_through_verl(every_rank, tmp_path / "llama")
    said = every_rank[0]["refusals"]
    assert said[0].startswith("--lr is verl's to set (optim.lr)"), said
    assert said[1].startswith("The trainer3d backend moves parameters, gradients and optimizer state to the host "
                              "together"), said
    assert said[2].startswith("The trainer3d backend applies verl's loss through a second forward pass"), said
    assert said[3] == "The trainer3d backend trains with AdamW; verl's optimizer config names 'adamw8bit'.", said
    assert said[4].startswith("--lora-rank is verl's to set (model.lora_rank)"), said
    assert said[5].startswith("The trainer3d backend's LoRA targets modules by name and excludes none"), said
    assert said[6].startswith("model.target_parameters ['gate.weight']: the trainer3d backend's LoRA takes a "
                              "mixture's experts' stacked weights (this model has none)"), said
    clipfrac = every_rank[0]["tp2 pp2"]["clipfrac"]  # (clipped at 1 ± ε, dual-clipped) summed over micro-batches
    assert all(upper > 0 and lower > 0 for upper, lower in clipfrac), clipfrac
    ref = every_rank[0]["reference llama"]
    assert len(set(ref["losses"])) == len(AGGREGATIONS) and min(ref["norms"]) > 0
    experts = [k for k in every_rank[0]["moe dp2 ep2 tp2"]["weights"] if ".mlp.experts." in k]
    assert len(experts) == 2 * 8 * 3 and "model.layers.1.mlp.experts.7.down_proj.weight" in experts, experts[:4]


def lora_through_verl(every_rank: list, hf_dir) -> None:
    """verl's LoRA model config (rank 4, α 8, q_proj and v_proj) at tp 2 × dp 2: verl's sft_loss equals the engine's
    LoRA run at one process; verl's weight syncs are the base as loaded (bitwise), then the adapters under PEFT's
    names with PEFT's config, or merged (model.lora.merge), each the engine's own stream; verl's log-probs under
    disable_adapter are transformers' base model's, and without it the merged model's (until 2026-12-08 BaseEngine's
    no-op scored verl's reference with the adapters on: the policy itself)."""
    from safetensors.torch import load_file

    loss, norm, merged, adapters = every_rank[0]["lora sft reference"]
    on_disk = load_file(Path(hf_dir) / "model.safetensors")
    for rank, result in enumerate(every_rank):
        got_loss, got_norm, base, base_config, got_adapters, peft_config, got_merged, merged_config, which, \
            reference, policy = result["lora sft tp2 dp2"]
        assert abs(got_loss - loss) < 1e-5 * loss and (got_norm is None or abs(got_norm - norm) < 1e-5 * norm), \
            (rank, got_loss, got_norm, loss, norm)
        assert sorted(base) == sorted(on_disk) and all(torch.equal(base[k], v) for k, v in on_disk.items()), rank
        assert base_config and merged_config is None
        assert sorted(got_adapters) == sorted(adapters) and len(adapters) == 2 * 2 * 2  # q, v; A, B; 2 layers
        assert max((got_adapters[k] - v).abs().max().item() for k, v in adapters.items()) < 1e-6, rank
        assert (peft_config["r"], peft_config["lora_alpha"], sorted(peft_config["target_modules"])) == \
            (4, 8.0, ["q_proj", "v_proj"]), peft_config
        assert sorted(got_merged) == sorted(merged)
        assert max((got_merged[k] - v).abs().max().item() for k, v in merged.items()) < 1e-6, rank
    moved = max((merged[k] - on_disk[k]).abs().max().item() for k in on_disk)
    assert moved > 1e-4, moved  # the merged weights carry the trained adapters (B moved off zero)
    seqs, _ = sft_sequences()
    hf = {"base": transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()}
    hf["merged"] = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    missing, unexpected = hf["merged"].load_state_dict(merged, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # (a tied head)
    gaps, apart = {"base": 0.0, "merged": 0.0}, 0.0
    for result in every_rank:
        which, reference, policy = result["lora sft tp2 dp2"][-3:]
        for i, ref, pol in zip(which, reference, policy):
            with torch.no_grad():
                want = {k: m(seqs[i][None]).logits[0, :-1].log_softmax(-1).gather(-1, seqs[i][1:, None])[:, 0]
                        for k, m in hf.items()}
            gaps["base"] = max(gaps["base"], (ref[:-1] - want["base"]).abs().max().item())
            gaps["merged"] = max(gaps["merged"], (pol[:-1] - want["merged"]).abs().max().item())
            apart = max(apart, (want["merged"] - want["base"]).abs().max().item())
    assert gaps["base"] < 1e-5 and gaps["merged"] < 1e-5 and apart > 1e-4, (gaps, apart)
