"""The Qwen3.5 family (models/qwen3_5/: Gated DeltaNet blocks with a gated full-attention block every 4th, dense and
MoE) against transformers' Qwen3_5ForCausalLM and Qwen3_5MoeForCausalLM: a random model trained by tests/helpers/reference.py's
plain loop and by trainer3d --init-from-hf gives the same loss and gradient norm at every step, in one process and at
tp 2, tp 2 with sequence parallelism, pp 2 (also with full recomputation), cp 2, cp 2 × tp 2 (also compiled by
dynamo) and ZeRO-3 (dense), dp 2 × ep 2 (MoE), and with
--document-mask on multi-document rows against transformers run on each document alone (1 process and cp 2), all in
one world of 4. The export of a run loads in transformers and generates greedily what `trainer3d.sample` does.
One process: the chunked recurrence against transformers' torch_chunk_gated_delta_rule and a step-by-step recurrence
written here, packed rows against each document alone (with the two mutations the rule guards against failing),
decoding against the whole forward, and the presets against their published sizes."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
import transformers

from helpers.distributed import run_world
from helpers.reference import plain_loop
from test_llama_hf import OPTIM, VOCAB, bpe_tokenizer, train_from_hf
from trainer3d.models import MODEL_PRESETS, build_model, canonical_shapes, init_value, plain_model
from trainer3d.models.qwen3_5 import delta_rule

SEQ, GB, STEPS = 80, 8, 5  # 80: more than one chunk of 64 in one process, and not a multiple of it
BOUNDARY = 0  # the test tokenizer's end-of-text (bpe_tokenizer's first special token)
# (MoE routing is discontinuous: tests/test_llama_hf.py's MOE_LR; the dense model too: at 3e-3 Adam's first steps
# amplify the two sides' rounding of near-zero gradients to 7e-6 of the norm by step 4, 1e-7 here)
LR = 1e-3


def hf_qwen35(seed: int = 0, moe: bool = False):
    """A random Qwen3.5, fp32: blocks 0-2 Gated DeltaNet and 3 full attention (the 3:1 pattern), 2 linear key heads
    serving 4 value heads of different widths (8 and 12), conv kernel 4, 4 attention heads over 2 kv heads of 16 dims
    with a quarter rotated; the MoE one top-2 of 8 experts with a gated shared expert. Every weight perturbed (the
    zero-centred norms off zero)."""
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_num_key_heads=4, linear_num_value_heads=8,
              linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4,
              max_position_embeddings=512, tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    torch.manual_seed(seed)
    if moe:
        config = transformers.Qwen3_5MoeTextConfig(**kw, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                                   shared_expert_intermediate_size=48)
        model = transformers.Qwen3_5MoeForCausalLM(config)
    else:
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**kw))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.eval()


def hf_qwen35_vl(directory, seed: int = 0) -> dict:
    """A random Qwen3_5ForConditionalGeneration (hf_qwen35's language model, a one-block vision tower) saved in
    `directory` with an MTP module's tensors added as the published files hold them (`mtp.*`, mtp_num_hidden_layers
    in text_config). Returns every tensor it stores that is no part of the language model."""
    import json

    from safetensors.torch import load_file, save_file

    text = hf_qwen35(seed).config.to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  num_position_embeddings=16)
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForConditionalGeneration(transformers.Qwen3_5Config(text_config=text,
                                                                                    vision_config=vision))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(directory)
    weights = load_file(directory / "model.safetensors")
    weights.update({"mtp.fc.weight": torch.randn(64, 128), "mtp.norm.weight": torch.randn(64),
                    "mtp.layers.0.mlp.down_proj.weight": torch.randn(64, 96).to(torch.bfloat16)})
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((directory / "config.json").read_text())
    raw["text_config"]["mtp_num_hidden_layers"] = 1
    (directory / "config.json").write_text(json.dumps(raw))
    return {k: v for k, v in weights.items() if not k.startswith(("model.language_model.", "lm_head."))}


def batches(steps: int = STEPS, vocab: int = VOCAB, documents: bool = False) -> torch.Tensor:
    """Two random global batches, alternating; with `documents`, rows packing several (each opened by BOUNDARY)."""
    pair = torch.randint(1, vocab, (2, GB, SEQ + 1), generator=torch.Generator().manual_seed(11))
    if documents:
        pair[:, :, [13, 14, 37, 61]] = BOUNDARY  # documents of 13, 1, 23, 24 and 20 tokens (two in one chunk)
        pair[1, ::2, [5, 50]] = BOUNDARY
    return pair[torch.arange(steps) % 2]


class PerDocument(torch.nn.Module):
    """A transformers model run on each document of a row alone (documents opened by BOUNDARY): the reference of a
    packed row under --document-mask. Its logits are the documents' side by side."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        rows = []
        for row in x:
            starts = [0] + [i for i in range(1, len(row)) if row[i] == BOUNDARY] + [len(row)]
            rows.append(torch.cat([self.model(row[None, s:e]).logits for s, e in zip(starts[:-1], starts[1:])], 1))
        return transformers.modeling_outputs.CausalLMOutput(logits=torch.cat(rows))


def _train(hf_dir: str, layout: dict, data: torch.Tensor, out_dir: str | None = None) -> dict | None:
    return train_from_hf(hf_dir, {"lr": LR, **layout}, data, out_dir,
                         boundary=BOUNDARY if layout.get("document_mask") else None)


LAYOUTS = {"1x1x1": {}, "tp2": dict(tp=2), "tp2 sp": dict(tp=2, sequence_parallel=True), "pp2": dict(pp=2),
           "cp2": dict(cp=2), "cp2 tp2": dict(cp=2, tp=2), "cp2 recompute": dict(cp=2, recompute="selective"),
           "pp2 recompute full": dict(pp=2, recompute="full"),
           # dynamo traces the blocks (the eager backend: no kernels built), the documents and exchange outside
           "tp2 cp2 compile": dict(tp=2, cp=2, compile=True, compile_backend="eager"),
           # at dp 4: DeepSpeed's barriers span the world
           "zero3 dp4": dict(dp=4, deepspeed_config="ds_configs/zero3.json")}
MOE_LAYOUTS = {"1x1x1": {}, "dp2 ep2 tp2": dict(dp=2, ep=2, tp=2)}
DOC_LAYOUTS = {"1x1x1": dict(document_mask=True), "cp2 tp2": dict(cp=2, tp=2, document_mask=True)}


def _world(rank, world_size, dense_dir, moe_dir, data, doc_data, run_dir, vl_dir, vl_run_dir):
    runs = {label: _train(dense_dir, layout, data, run_dir if label == "1x1x1" else None)
            for label, layout in LAYOUTS.items()}
    runs["vl tp2"] = _train(vl_dir, dict(tp=2), data[:2], vl_run_dir)  # a multimodal directory's language model
    runs.update({f"moe {label}": _train(moe_dir, layout, data) for label, layout in MOE_LAYOUTS.items()})
    runs.update({f"docs {label}": _train(dense_dir, layout, doc_data) for label, layout in DOC_LAYOUTS.items()})
    return runs


def _rel(run: dict, ref: tuple) -> float:
    return max(abs(a - b) / b for a, b in zip(run["losses"] + run["norms"], ref[0] + ref[1]))


def test_trains_like_transformers_and_exports(tmp_path, capsys):
    """Dense at eight layouts, MoE at two and the document mask at two, each against transformers trained by the plain
    loop (the document mask's: transformers on each document alone): losses and gradient norms within 1e-5
    (relative) at every step. The one-process dense run, exported, loads as Qwen3_5ForCausalLM with trainer3d's
    logits, and its greedy generation is `trainer3d.sample --temperature 0`'s."""
    from trainer3d.checkpoint.format import Checkpoint
    from trainer3d.export import main as export_main
    from trainer3d.sample import main as sample_main

    dense, moe = hf_qwen35(seed=3), hf_qwen35(seed=4, moe=True)
    dense.save_pretrained(tmp_path / "dense")
    moe.save_pretrained(tmp_path / "moe")
    n_tokens = bpe_tokenizer(tmp_path / "dense")
    data, doc_data = batches(), batches(documents=True)
    step = dict(warmup_steps=OPTIM["warmup_steps"], max_steps=OPTIM["max_steps"], grad_clip=OPTIM["grad_clip"],
                weight_decay=OPTIM["weight_decay"])
    refs = {"": plain_loop(copy.deepcopy(dense), data, lr=LR, **step),
            "moe ": plain_loop(copy.deepcopy(moe), data, lr=LR, **step),
            "docs ": plain_loop(PerDocument(copy.deepcopy(dense)), doc_data, lr=LR, **step)}
    untrained = hf_qwen35_vl(tmp_path / "vl", seed=5)
    results = run_world(4, _world, str(tmp_path / "dense"), str(tmp_path / "moe"), data, doc_data,
                        str(tmp_path / "run"), str(tmp_path / "vl"), str(tmp_path / "vl_run"), timeout=900)
    ours = results[0]
    report = []
    for prefix, layouts in (("", LAYOUTS), ("moe ", MOE_LAYOUTS), ("docs ", DOC_LAYOUTS)):
        for label in layouts:
            rel = _rel(ours[prefix + label], refs[prefix])
            report.append(f"trainer3d {prefix}{label}: loss and grad norm rel diff {rel:.1e}")
            assert rel < 1e-5, (prefix + label, ours[prefix + label], refs[prefix])
    assert ours["tp2 cp2 compile"]["graphs"] > 0 and ours["tp2"]["graphs"] == 0  # --compile acted
    for ref in refs.values():  # it trains, clipping acts
        assert ref[0][-1] < ref[0][0] - 0.05 and max(ref[1]) > OPTIM["grad_clip"], ref
    # the document mask acts: the packed rows' reference differs from the plain one on the same rows
    plain_docs = plain_loop(copy.deepcopy(dense), doc_data[:1], lr=LR, **step)
    assert abs(plain_docs[0][0] - refs["docs "][0][0]) > 1e-3, (plain_docs, refs["docs "])

    path = ours["1x1x1"]["path"]
    assert export_main([path, str(tmp_path / "export")]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert type(exported) is transformers.Qwen3_5ForCausalLM
    ckpt = Checkpoint(path)
    x = data[0, :2, :-1]
    with torch.no_grad():
        diff = (plain_model(ckpt.model_config, ckpt.model_state(), torch.device("cpu"), torch.float32)(x)
                - exported(x).logits).abs().max().item()
    report.append(f"export: logits diff {diff:.1e}")
    assert diff < 1e-5
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    prompt = "the king and queen"
    ids = tok(prompt, return_tensors="pt").input_ids
    assert ids.max() < n_tokens
    greedy = exported.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.eos_token_id)
    capsys.readouterr()
    assert sample_main([path, "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "12"]) == 0
    printed = capsys.readouterr().out.split("\n", 1)[1].rstrip("\n")
    assert printed == tok.decode(greedy[0], skip_special_tokens=True), (printed, greedy)
    report.append(_check_multimodal_export(ours["vl tp2"], untrained, tmp_path))
    with capsys.disabled():
        print("\n" + "\n".join(report))


def _check_multimodal_export(run: dict, untrained: dict, tmp_path) -> str:
    """A run from a Qwen3_5ForConditionalGeneration directory (its log naming what is not trained) exports the same
    architecture under its config: the vision tower and the MTP module bitwise as they were, the language model as
    trained (transformers' text logits are trainer3d's); with the directory gone, the export is refused in one
    sentence and writes nothing."""
    import json
    import shutil

    from safetensors import safe_open

    from trainer3d.checkpoint.format import Checkpoint
    from trainer3d.export import main as export_main

    assert any("vision tower" in n for n in run["notes"]) and any("mtp.*, 1 layer" in n for n in run["notes"])
    assert export_main([run["path"], str(tmp_path / "vl_export")]) == 0
    out = tmp_path / "vl_export"
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3_5ForConditionalGeneration"] and raw["vision_config"]["depth"] == 1
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    stored = {}
    for name, file in index.items():
        if not name.startswith(("model.language_model.", "lm_head.")):
            with safe_open(str(out / file), "pt") as f:
                stored[name] = f.get_tensor(name)
    assert stored.keys() == untrained.keys()
    assert all(stored[k].dtype == v.dtype and torch.equal(stored[k], v) for k, v in untrained.items())
    exported = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(out).eval()
    ckpt = Checkpoint(run["path"])
    x = batches()[0, :2, :-1]
    with torch.no_grad():
        diff = (plain_model(ckpt.model_config, ckpt.model_state(), torch.device("cpu"), torch.float32)(x)
                - exported(input_ids=x).logits).abs().max().item()
    assert diff < 1e-5, diff
    shutil.move(tmp_path / "vl", tmp_path / "vl_moved")
    assert export_main([run["path"], str(tmp_path / "vl_export2")]) == 2 and not (tmp_path / "vl_export2").exists()
    return f"multimodal export: {len(untrained)} tensors copied bitwise, text logits diff {diff:.1e}"


# ---- one process ------------------------------------------------------------------------------------------------
def step_by_step(q, k, v, g, beta):
    """The gated delta rule token by token, as the paper writes it (q, k L2-normalised here, q scaled by dk^-1/2):
    S_t = e^{g_t} S_{t-1} + k_t β_t (v_t - (e^{g_t} S_{t-1})ᵀ k_t)ᵀ, o_t = S_tᵀ q_t; one key head per value head."""
    q, k = F.normalize(q, dim=-1, eps=1e-3) * q.shape[-1] ** -0.5, F.normalize(k, dim=-1, eps=1e-3)
    B, T, H, dk = k.shape
    S = torch.zeros(B, H, dk, v.shape[-1], dtype=q.dtype)
    out = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None]
        delta = (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t])) * beta[:, t, :, None]
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], delta)
        out.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(out, dim=1)


def _inputs(T: int, B: int = 2, Hk: int = 2, Hv: int = 4, dk: int = 8, dv: int = 6, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, Hk, dk, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, T, Hv, dv, generator=gen, dtype=torch.float64)
    g = -torch.rand(B, T, Hv, generator=gen, dtype=torch.float64) * 2
    return q, k, v, g, torch.rand(B, T, Hv, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("T,chunk", [(100, 64), (100, 16), (130, 7), (5, 64)])
def test_the_chunked_recurrence_is_transformers_and_the_step_by_step_rule(T, chunk):
    """The chunked form (lengths that are no multiple of the chunk) against transformers' torch_chunk_gated_delta_rule
    (chunks of 64) and the recurrence token by token written above, with its final state (decoding's)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    q, k, v, g, beta = _inputs(T)
    ours, state = delta_rule.chunk_gated_delta_rule(delta_rule.l2_normalize(q), delta_rule.l2_normalize(k), v, g,
                                                    beta, chunk_size=chunk, final_state=True)
    theirs, their_state = torch_chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True,
                                                       output_final_state=True)
    torch.testing.assert_close(ours, theirs.to(ours.dtype), rtol=0, atol=2e-6)
    torch.testing.assert_close(state, their_state, rtol=0, atol=2e-6)
    rep = lambda t: t.repeat_interleave(2, dim=2)  # noqa: E731 (each key head serves two value heads)
    torch.testing.assert_close(ours, step_by_step(rep(q), rep(k), v, g, beta), rtol=0, atol=2e-6)


def test_documents_restart_the_state_and_the_convolution():
    """A packed row through the recurrence and the convolution equals its documents run alone (documents of 37 and
    63 tokens, the boundary inside a chunk), and each part reads across the boundary without the documents."""
    q, k, v, g, beta = _inputs(100)
    docs = torch.zeros(2, 100, dtype=torch.long)
    docs[:, 37:] = 1
    norm = delta_rule.l2_normalize
    packed, _ = delta_rule.chunk_gated_delta_rule(norm(q), norm(k), v, g, beta, docs, chunk_size=16)
    alone = torch.cat([delta_rule.chunk_gated_delta_rule(norm(q[:, s]), norm(k[:, s]), v[:, s], g[:, s], beta[:, s],
                                                         chunk_size=16)[0] for s in (slice(0, 37), slice(37, 100))], 1)
    torch.testing.assert_close(packed, alone, rtol=0, atol=2e-6)
    crossing, _ = delta_rule.chunk_gated_delta_rule(norm(q), norm(k), v, g, beta, chunk_size=16)
    assert (crossing[:, 37:] - alone[:, 37:]).abs().max() > 1e-2
    x, w = torch.randn(2, 100, 10), torch.randn(10, 4)
    conv = delta_rule.causal_conv(x, w, docs)
    torch.testing.assert_close(conv, torch.cat([delta_rule.causal_conv(x[:, :37], w),
                                                delta_rule.causal_conv(x[:, 37:], w)], 1))
    assert (delta_rule.causal_conv(x, w)[:, 37:40] - conv[:, 37:40]).abs().max() > 1e-2
    reference = F.silu(F.conv1d(x.transpose(1, 2), w[:, None], padding=3, groups=10)[..., :100]).transpose(1, 2)
    torch.testing.assert_close(delta_rule.causal_conv(x, w), reference)  # (nn.Conv1d's, as transformers runs it)


def _tiny(**overrides):
    cfg = dataclasses.replace(MODEL_PRESETS["qwen3.5-tiny"], vocab_size=96, **overrides)
    state = {n: init_value(cfg, n, s, 1234) + (0.05 * torch.randn(s) if n.endswith("norm.weight") else 0)
             for n, s in canonical_shapes(cfg).items()}
    return cfg, state


@pytest.mark.parametrize("mutation", [None, "conv", "state"])
def test_packed_rows_equal_each_document_alone(mutation, monkeypatch):
    """Under --document-mask every token of a packed row gets the log-probabilities of its document run alone
    (1e-5), at the family's chunk of 64 over 100 tokens; and the comparison fails where the convolution's window or
    the recurrent state crosses a boundary (each mutation: the part run without the documents)."""
    from trainer3d.models.qwen3_5 import model as qwen_model
    from trainer3d.parallel.context_parallel import SequenceLayout, apply_context_parallel

    if mutation == "conv":
        monkeypatch.setattr(qwen_model, "causal_conv", lambda x, w, docs, window: delta_rule.causal_conv(x, w))
    if mutation == "state":
        real = delta_rule.chunk_gated_delta_rule
        monkeypatch.setattr(qwen_model, "chunk_gated_delta_rule", lambda *a, **kw: real(*a[:5], **kw))
    cfg, state = _tiny()
    plain = plain_model(cfg, state, torch.device("cpu"), torch.float32)
    masked = plain_model(cfg, state, torch.device("cpu"), torch.float32)
    tokens = torch.randint(1, 96, (2, 100), generator=torch.Generator().manual_seed(0))
    tokens[0, [30, 31, 70]] = BOUNDARY
    tokens[1, [64]] = BOUNDARY
    layout = SequenceLayout(100, None, 0, 1, torch.device("cpu"), boundary=BOUNDARY, document_mask=True)
    apply_context_parallel(masked, layout)
    layout.begin_pass(tokens, 1)
    with torch.no_grad():
        packed = masked(tokens).log_softmax(-1)
        diffs = []
        for b in range(2):
            starts = [0] + [i for i in range(1, 100) if tokens[b, i] == BOUNDARY] + [100]
            for s, e in zip(starts[:-1], starts[1:]):
                diffs.append((plain(tokens[b:b + 1, s:e]).log_softmax(-1) - packed[b:b + 1, s:e]).abs().max().item())
    assert (max(diffs) < 1e-5) == (mutation is None), (mutation, diffs)


def test_decoding_keeps_the_state_and_equals_the_whole_forward():
    """A prefill then token-by-token decoding (the cache: each linear block's conv window and state, each full block's
    keys and values) gives the whole sequence's logits at every position; prompts shorter than the conv window too."""
    from trainer3d.models.attention import KVCache

    cfg, state = _tiny()
    model = plain_model(cfg, state, torch.device("cpu"), torch.float32)
    ids = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = model(ids)
        for prefill in (2, 9):
            cache = KVCache(max_len=20)
            steps = [model(ids[:, :prefill], cache)] + [model(ids[:, t:t + 1], cache) for t in range(prefill, 20)]
            torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=1e-5, atol=1e-5)
    linear = [i for i in range(cfg.n_layer) if cfg.is_linear(i)]
    assert sorted(cache.states) == linear and sorted(cache.k) == [3, 7]
    window, S = cache.states[0]
    assert window.shape == (2, cfg.linear_conv_kernel - 1, cfg.conv_width)
    assert S.shape == (2, cfg.linear_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)


@pytest.mark.parametrize("name,total,active,rel", [
    ("qwen3.5-0.8b", 0.8, None, 0.07), ("qwen3.5-4b", 4, None, 0.06), ("qwen3.5-9b", 9, None, 0.02),
    ("qwen3.5-27b", 27, None, 0.01), ("qwen3.5-35b-a3b", 35, 3, 0.16), ("qwen3.5-122b-a10b", 122, 10, 0.03),
    ("qwen3.5-397b-a17b", 397, 17, 0.03)])
def test_presets_are_the_published_sizes(name, total, active, rel):
    """The formula's parameter counts (without the MTP module or the vision tower, which the names count) are the
    sizes the names give, in billions, total and active (A3B's 3.45 is named 3), and equal what the model builds."""
    cfg = MODEL_PRESETS[name]
    assert abs(cfg.num_params() / 1e9 - total) / total < rel, cfg.num_params() / 1e9
    if active is not None:
        assert abs(cfg.num_params(active=True) / 1e9 - active) / active < rel, cfg.num_params(active=True) / 1e9
    small = dataclasses.replace(cfg, n_layer=4, vocab_size=512)
    with torch.device("meta"):
        built = sum(p.numel() for p in build_model(small).parameters())
    assert built == small.num_params()
