"""Hugging Face GPT-2 interop: our model and transformers' GPT2LMHeadModel give the same logits both ways."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from trainer3d.checkpoint.hf import load_hf_checkpoint
from trainer3d.checkpoint.hf_save import save_hf_checkpoint
from trainer3d.models import init_value
from trainer3d.models.gpt2 import GPT, GPTConfig
from trainer3d.models.gpt2.hf import GPT2Adapter

ADAPTER = GPT2Adapter()


def gpt_config_from_hf(hf, dropout=None) -> GPTConfig:
    return ADAPTER.config_from_hf(hf if isinstance(hf, dict) else hf.to_dict(), dropout)


def hf_config_from_gpt(cfg: GPTConfig):
    return ADAPTER.hf_config(cfg)

TOL = 1e-5
SMALL = dict(n_layer=2, n_head=4, n_embd=64, n_positions=64, vocab_size=1000)


def _hf_config(**overrides):
    kw = dict(SMALL, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    kw.update(overrides)
    return transformers.GPT2Config(**kw)


def _hf_model(seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(_hf_config()).eval()
    # Random init leaves biases at 0 and LayerNorms at 1; perturb everything so the comparison sees them.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def _our_model(cfg: GPTConfig, seed: int = 0) -> GPT:
    # The trainer's GPT-2 init (init_value), not nn.Module defaults: nn.Embedding's N(0, 1) would make the
    # tied head's logits ~65 in size, where float32 rounding alone is ~1e-5 (both models agree to 1e-14 in
    # float64; see test_ours_to_hf_float64_exact).
    torch.manual_seed(seed)
    model = GPT(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # lm_head.weight is wte.weight, listed once
            p.copy_(init_value(cfg, name, p.shape, seed) + torch.randn_like(p) * 0.02)
    return model


def _load_into_ours(cfg: GPTConfig, state: dict[str, torch.Tensor]) -> GPT:
    model = GPT(cfg)
    result = model.load_state_dict(state, strict=False)
    assert result.missing_keys == ["lm_head.weight"]  # tied to wte, which was loaded
    assert result.unexpected_keys == []
    assert model.lm_head.weight is model.wte.weight
    return model.eval()


def _tokens(vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (3, 48), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    model = _hf_model()
    path = tmp_path_factory.mktemp("hf") / "gpt2-small-random"
    model.save_pretrained(path)
    return path, model


def test_config_round_trip():
    cfg = GPTConfig(vocab_size=1000, n_positions=64, n_embd=64, n_layer=2, n_head=4, dropout=0.1,
                    layer_norm_eps=1e-6)
    hf = hf_config_from_gpt(cfg)
    assert hf.architectures == ["GPT2LMHeadModel"]
    assert hf.tie_word_embeddings and hf.activation_function == "gelu_new"
    assert hf.bos_token_id is None  # no <|endoftext|> in a 1000-token vocabulary
    assert gpt_config_from_hf(hf) == cfg
    assert gpt_config_from_hf(hf.to_dict()) == cfg
    assert hf_config_from_gpt(GPTConfig()).eos_token_id == 50256
    assert gpt_config_from_hf({}) == GPTConfig(dropout=0.1)  # config.json keys default like GPT2Config
    assert gpt_config_from_hf(_hf_config(activation_function="gelu_pytorch_tanh")).n_embd == 64


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(activation_function="relu"), "activation_function='relu'"),
        (dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
        (dict(reorder_and_upcast_attn=True), "reorder_and_upcast_attn"),
        (dict(n_inner=128), "n_inner=128"),
        (dict(add_cross_attention=True), "add_cross_attention"),
        (dict(tie_word_embeddings=False), "tie_word_embeddings=False"),
        (dict(scale_attn_weights=False), "scale_attn_weights=False"),
        (dict(attn_pdrop=0.1), "dropout rates differ"),
    ],
)
def test_refuses_unsupported_config(overrides, message):
    with pytest.raises(ValueError, match="unsupported GPT-2 config") as info:
        gpt_config_from_hf(_hf_config(**overrides))
    assert message in str(info.value)


def test_dropout_override():
    assert gpt_config_from_hf(_hf_config(attn_pdrop=0.1), dropout=0.2).dropout == 0.2
    assert gpt_config_from_hf(_hf_config(n_inner=256)).n_embd == 64  # n_inner == 4 * n_embd is fine


def test_hf_to_ours_logits(hf_dir):
    path, hf_model = hf_dir
    cfg, state = load_hf_checkpoint(path)
    assert cfg == GPTConfig(**SMALL, dropout=0.0, layer_norm_eps=1e-5)
    assert "lm_head.weight" not in state and state["wte.weight"].shape == (1000, 64)
    assert state["h.0.attn.c_attn.weight"].shape == (192, 64)  # nn.Linear layout [out, in]
    ours = _load_into_ours(cfg, state)
    x = _tokens(cfg.vocab_size)
    with torch.no_grad():
        diff = (ours(x) - hf_model(x).logits).abs().max().item()
    print(f"HF -> ours max |logit diff| = {diff:.3e}")
    assert diff < TOL


def test_ours_to_hf_logits_and_generate(tmp_path):
    cfg = GPTConfig(**SMALL, dropout=0.0)
    ours = _our_model(cfg, seed=3)
    out = save_hf_checkpoint(cfg, ours.state_dict(), tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["model_type"] == "gpt2"
    hf_model = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    assert hf_model.lm_head.weight.data_ptr() == hf_model.transformer.wte.weight.data_ptr()
    x = _tokens(cfg.vocab_size, seed=2)
    with torch.no_grad():
        diff = (ours(x) - hf_model(x).logits).abs().max().item()
    print(f"ours -> HF max |logit diff| = {diff:.3e}")
    assert diff < TOL
    generated = hf_model.generate(x[:1, :8], max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 13)
    # Greedy generation agrees with our model's argmax.
    with torch.no_grad():
        assert torch.equal(ours(generated[:, :-1])[:, 7:].argmax(-1), generated[:, 8:])

    # Round trip back into canonical form is exact.
    cfg2, state2 = load_hf_checkpoint(out)
    assert cfg2 == cfg
    for name, tensor in state2.items():
        assert torch.equal(tensor, ours.state_dict()[name]), name


def test_ours_to_hf_float64_exact(tmp_path):
    """With nn.Module default init (large logits) float32 rounding dominates; in float64 the two agree."""
    cfg = GPTConfig(**SMALL, dropout=0.0)
    torch.manual_seed(5)
    ours = GPT(cfg).double().eval()
    save_hf_checkpoint(cfg, ours.state_dict(), tmp_path / "export", dtype=torch.float64)
    hf_model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "export", dtype=torch.float64).eval()
    assert hf_model.lm_head.weight.dtype == torch.float64
    x = _tokens(cfg.vocab_size, seed=4)
    with torch.no_grad():
        ref = ours(x)
        diff = (ref - hf_model(x).logits).abs().max().item()
    print(f"ours -> HF float64 max |logit diff| = {diff:.3e} (max |logit| {ref.abs().max().item():.1f})")
    assert diff < 1e-10


def test_save_dtype_tokenizer_and_overwrite(tmp_path):
    cfg = GPTConfig(**SMALL, dropout=0.0)
    state = {k: v.to(torch.bfloat16) for k, v in _our_model(cfg).state_dict().items() if k != "lm_head.weight"}
    tok = tmp_path / "tok"
    (tok / "sub").mkdir(parents=True)
    (tok / "vocab.json").write_text("{}")
    (tok / "merges.txt").write_text("#version: 0.2\n")
    (tok / "sub" / "extra.txt").write_text("x")
    out = tmp_path / "export"
    save_hf_checkpoint(cfg, state, out, tokenizer_dir=tok)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
        "config.json", "merges.txt", "model.safetensors", "sub/extra.txt", "vocab.json"]
    _, loaded = load_hf_checkpoint(out, dtype=None)
    assert loaded["wte.weight"].dtype == torch.float32  # saved as float32 by default
    assert torch.equal(loaded["wte.weight"], state["wte.weight"].float())

    with pytest.raises(FileExistsError, match="already exists"):
        save_hf_checkpoint(cfg, state, out)
    save_hf_checkpoint(cfg, state, out, dtype=torch.bfloat16, overwrite=True)
    assert not (out / "vocab.json").exists()  # replaced wholesale
    _, loaded = load_hf_checkpoint(out, dtype=None)
    assert loaded["wte.weight"].dtype == torch.bfloat16
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp dirs left

    # A bad state dict fails before anything is written.
    bad = dict(state)
    del bad["h.1.mlp.c_fc.bias"]
    with pytest.raises(ValueError, match=r"missing tensors \['h.1.mlp.c_fc.bias'\]"):
        save_hf_checkpoint(cfg, bad, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
    with pytest.raises(FileNotFoundError, match="tokenizer directory"):
        save_hf_checkpoint(cfg, state, tmp_path / "bad", tokenizer_dir=tmp_path / "nope")


BUNDLED_TOKENIZER = Path(__file__).resolve().parents[1] / "trainer3d" / "assets" / "gpt2_tokenizer"


def test_export_with_bundled_tokenizer(tmp_path):
    cfg = GPTConfig(vocab_size=50257, n_positions=64, n_embd=32, n_layer=1, n_head=2)
    out = save_hf_checkpoint(cfg, _our_model(cfg).state_dict(), tmp_path / "export", tokenizer_dir=BUNDLED_TOKENIZER)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("Hello world").input_ids == [15496, 995] and tok.eos_token_id == 50256
    hf_model = transformers.GPT2LMHeadModel.from_pretrained(out)
    assert hf_model.config.eos_token_id == 50256
    ids = tok("Hello world", return_tensors="pt")
    assert hf_model.generate(**ids, max_new_tokens=3, do_sample=False).shape == (1, 5)


def test_sharded_legacy_and_hf_layouts(tmp_path, hf_dir):
    path, hf_model = hf_dir
    _, reference = load_hf_checkpoint(path)

    sharded = tmp_path / "sharded"
    hf_model.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert not (sharded / "model.safetensors").exists()
    cfg, state = load_hf_checkpoint(sharded)
    assert state.keys() == reference.keys()
    assert all(torch.equal(state[k], reference[k]) for k in state)

    # Legacy pytorch_model.bin in GPT2Model naming (no `transformer.` prefix, causal-mask buffers, and an
    # explicit lm_head.weight), as older hub checkpoints have.
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "config.json").write_text((path / "config.json").read_text())
    sd = {k.removeprefix("transformer."): v.clone() for k, v in hf_model.state_dict().items()}
    sd["lm_head.weight"] = sd["wte.weight"].clone()
    for i in range(cfg.n_layer):
        sd[f"h.{i}.attn.bias"] = torch.tril(torch.ones(64, 64)).view(1, 1, 64, 64)
        sd[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    torch.save(sd, legacy / "pytorch_model.bin")
    _, state = load_hf_checkpoint(legacy)
    assert all(torch.equal(state[k], reference[k]) for k in reference) and state.keys() == reference.keys()

    # An untied lm_head is refused.
    sd["lm_head.weight"] = sd["lm_head.weight"] + 1
    torch.save(sd, legacy / "pytorch_model.bin")
    with pytest.raises(ValueError, match="lm_head.weight' differs"):
        load_hf_checkpoint(legacy)


def test_missing_files_and_tensors(tmp_path, hf_dir):
    path, _ = hf_dir
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf_checkpoint(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_hf_checkpoint(empty)
    (empty / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="has no weights: looked for model.safetensors"):
        load_hf_checkpoint(empty)

    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    del tensors["transformer.h.1.attn.c_proj.weight"]
    save_file(tensors, empty / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.safetensors: missing tensors \['h.1.attn.c_proj.weight'\]"):
        load_hf_checkpoint(empty)

    bad_cfg = tmp_path / "relu"
    bad_cfg.mkdir()
    config = json.loads((path / "config.json").read_text())
    (bad_cfg / "config.json").write_text(json.dumps(dict(config, activation_function="relu")))
    with pytest.raises(ValueError, match=r"config\.json: unsupported GPT-2 config: activation_function='relu'"):
        load_hf_checkpoint(bad_cfg)

    # A shard listed in the index but absent.
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((path / "config.json").read_text())
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"transformer.wte.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors is missing"):
        load_hf_checkpoint(sharded)


def test_nonfinite_weights_are_refused_naming_the_tensor(tmp_path, monkeypatch, capsys):
    """--init-from-hf of a directory with a nan in one weight: one sentence naming that tensor, exit 2, before any
    step (every rank refuses together, once each has read its shards)."""
    from test_llama_hf import bpe_tokenizer
    from trainer3d.train.loop import main

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    model = _hf_model()
    with torch.no_grad():
        model.transformer.h[1].mlp.c_proj.weight[3, 5] = float("nan")
    model.save_pretrained(tmp_path / "hf")
    bpe_tokenizer(tmp_path / "hf")  # 400 tokens: the model's 1000 cover them
    out = tmp_path / "run"
    rc = main(["--init-from-hf", str(tmp_path / "hf"), "--seq-len", "32", "--global-batch", "2", "--max-steps", "2",
               "--eval-every", "0", "--out-dir", str(out)])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert (f"trainer3d: error: --init-from-hf {tmp_path / 'hf'}: transformer.h.1.mlp.c_proj.weight holds nan or inf "
            "values") in err and "Traceback" not in err, err
    assert not (out / "metrics.jsonl").exists() or (out / "metrics.jsonl").read_text() == ""
