"""The Llama family against Hugging Face's LlamaForCausalLM, one process: config.json in both spellings, Llama 3.1's
rotary frequencies, logits both ways (untied and tied heads, grouped-query attention), the KV cache, sharded
directories, the published shapes; and what is refused."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from trainer3d.checkpoint.hf import HFDirectory, load_hf_checkpoint
from trainer3d.checkpoint.hf_save import save_hf_checkpoint
from trainer3d.models import MODEL_PRESETS, plain_model
from trainer3d.models.attention import KVCache
from trainer3d.models.llama import LlamaConfig
from trainer3d.models.llama.hf import LlamaAdapter
from trainer3d.models.llama.model import rope_frequencies

ADAPTER = LlamaAdapter()
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


def hf_llama(tie: bool = False, seed: int = 0, **overrides):
    """A random LlamaForCausalLM with grouped-query attention (4 query heads on 2 kv heads) and Llama 3.1's rope
    scaling; every weight perturbed so that the norms' gains are not all 1."""
    kw = dict(vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=16384, rms_norm_eps=1e-5,
              rope_parameters={**LLAMA31_ROPE, "rope_theta": 500000.0}, tie_word_embeddings=tie)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def tokens(vocab: int = 1000, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (3, 40), generator=torch.Generator().manual_seed(seed))


def test_config_json_in_both_spellings():
    """transformers 4's rope_theta + rope_scaling (the published 3.1/3.2 files) and transformers 5's rope_parameters
    read the same; a config without rope scaling is plain RoPE."""
    published_31_8b = {  # meta-llama/Llama-3.1-8B config.json (transformers 4.43)
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
        "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False,
        "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": {**LLAMA31_ROPE, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256,
    }
    old = ADAPTER.config_from_hf(published_31_8b)
    assert old == MODEL_PRESETS["llama3.1-8b"]
    new = ADAPTER.config_from_hf(ADAPTER.hf_config(old).to_dict())  # transformers 5 writes rope_parameters
    assert new == old and "rope_parameters" in ADAPTER.hf_config(old).to_dict()
    plain = ADAPTER.config_from_hf({**published_31_8b, "rope_scaling": None})
    assert plain.rope_factor is None and plain.rope_theta == 500000.0
    tied_32_1b = {**published_31_8b, "hidden_size": 2048, "num_hidden_layers": 16, "intermediate_size": 8192,
                  "head_dim": 64, "tie_word_embeddings": True, "rope_scaling": {**LLAMA31_ROPE, "factor": 32.0}}
    assert ADAPTER.config_from_hf(tied_32_1b) == MODEL_PRESETS["llama3.2-1b"]


@pytest.mark.parametrize("overrides, message", [
    ({"attention_bias": True}, "attention_bias=True"),
    ({"mlp_bias": True}, "mlp_bias=True"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
    ({"num_attention_heads": 6, "num_key_value_heads": 4}, "not a multiple of num_key_value_heads=4"),
])
def test_refuses_what_it_cannot_represent(overrides, message):
    raw = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, **overrides}
    with pytest.raises(ValueError, match="unsupported Llama config") as info:
        ADAPTER.config_from_hf(raw)
    assert message in str(info.value)


@pytest.mark.parametrize("preset", ["llama3.1-8b", "llama3.2-1b", "llama-tiny"])
def test_rope_frequencies_equal_transformers(preset):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = MODEL_PRESETS[preset]
    hf_cfg = ADAPTER.hf_config(cfg)
    expected, scaling = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    assert scaling == 1.0 and torch.equal(rope_frequencies(cfg), expected)
    plain = LlamaConfig(rope_factor=None)
    assert torch.equal(rope_frequencies(plain), 1.0 / 500000.0 ** (torch.arange(0, 128, 2).float() / 128))


def test_published_shapes():
    """Parameter counts of the presets against the published sizes (Llama 3.1/3.2 model cards)."""
    counts = {name: MODEL_PRESETS[name].num_params() / 1e9 for name in
              ("llama3.2-1b", "llama3.2-3b", "llama3.1-8b", "llama3.1-70b", "llama3.1-405b")}
    assert counts == pytest.approx({"llama3.2-1b": 1.236, "llama3.2-3b": 3.213, "llama3.1-8b": 8.030,
                                    "llama3.1-70b": 70.554, "llama3.1-405b": 405.853}, abs=1e-3)
    assert all(MODEL_PRESETS[n].vocab_size == 128256 for n in counts)
    assert MODEL_PRESETS["llama3.2-3b"].head_dim == 128 and MODEL_PRESETS["llama3.2-1b"].head_dim == 64


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_hf_weights_give_transformers_logits_and_back(tmp_path, tie):
    hf = hf_llama(tie=tie)
    hf.save_pretrained(tmp_path / "hf")
    cfg, state = load_hf_checkpoint(tmp_path / "hf")
    assert cfg.tie_embeddings == tie and cfg.n_kv_heads == 2 and cfg.rope_factor == 8.0
    assert state["layers.0.self_attn.qkv_proj.weight"].shape == (64 + 2 * 32, 64)  # q | k | v fused
    assert state["layers.0.mlp.gate_up_proj.weight"].shape == (2 * 160, 64)  # gate | up fused
    assert ("lm_head.weight" in state) == (not tie)
    ours = plain_model(cfg, state, torch.device("cpu"), torch.float32)
    x = tokens()
    with torch.no_grad():
        diff = (ours(x) - hf(x).logits).abs().max().item()
    assert diff < 1e-5, diff

    out = save_hf_checkpoint(cfg, state, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_key_value_heads"] == 2
    back = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert (back(x).logits - hf(x).logits).abs().max().item() == 0.0  # split exactly as it was fused
    if tie:
        assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()


def test_kv_cache_keeps_only_the_kv_heads():
    hf = hf_llama()
    cfg = ADAPTER.config_from_hf(hf.config.to_dict())
    ours = plain_model(cfg, {n: t for n, t in _canonical(hf, cfg).items()}, torch.device("cpu"), torch.float32)
    x = tokens()
    cache = KVCache(max_len=40)
    with torch.no_grad():
        full = ours(x)
        prefill = ours(x[:, :30], kv_cache=cache)
        one = ours(x[:, 30:31], kv_cache=cache)
        rest = ours(x[:, 31:], kv_cache=cache)
    assert cache.k[0].shape == (3, 2, 40, 16)  # [batch, kv heads (not the 4 query heads), positions, head dim]
    for got, want in ((prefill, full[:, :30]), (one, full[:, 30:31]), (rest, full[:, 31:])):
        assert (got - want).abs().max().item() < 1e-5


def _canonical(hf, cfg) -> dict[str, torch.Tensor]:
    sd = hf.state_dict()
    from trainer3d.models import canonical_shapes

    return {n: ADAPTER.from_hf(cfg, n, [sd[s] for s in ADAPTER.sources(cfg, n)]) for n in canonical_shapes(cfg)}


def test_sharded_directory_reads_each_tensor_from_its_shard(tmp_path):
    hf = hf_llama()
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    d = HFDirectory(tmp_path / "sharded")
    d.check()
    single = tmp_path / "single"
    hf.save_pretrained(single)
    _, reference = load_hf_checkpoint(single)
    assert all(torch.equal(d.tensor(n).float(), t) for n, t in reference.items())

    # a tensor missing from its shard's index entry, and an extra one, are named
    weight_map = dict(index["weight_map"])
    del weight_map["model.layers.1.self_attn.k_proj.weight"]
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match=r"missing tensors \['layers.1.self_attn.qkv_proj.weight'\]"):
        HFDirectory(tmp_path / "sharded").check()


def test_export_refuses_a_state_that_does_not_fit(tmp_path):
    cfg = ADAPTER.config_from_hf(hf_llama().config.to_dict())
    state = _canonical(hf_llama(), cfg)
    del state["layers.1.mlp.down_proj.weight"]
    with pytest.raises(ValueError, match=r"missing tensors \['layers.1.mlp.down_proj.weight'\]"):
        save_hf_checkpoint(cfg, state, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
