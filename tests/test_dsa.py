"""DeepSeek Sparse Attention (models/deepseek_v3/indexer.py, parallel/dsa.py) against transformers' DeepseekV32ForCausalLM
and GlmMoeDsaForCausalLM: a random one (MLA, 2 dense + 2 MoE blocks, index_topk 6 of 32 tokens, so selection
matters) trained by the plain loop, whose loss is transformers' cross-entropy (its indexer selects the same keys)
plus the indexer's KL written here from the DeepSeek-V3.2 report, and by trainer3d --init-from-hf in --dsa-stage
sparse: the same loss, gradient norm and KL at every step in one process, tp 2, pp 2 with full recomputation, cp 2,
dp 2 × ep 2 and ZeRO-3 at dp 4 × ep 2; under --document-mask against transformers run on each document alone, in one
process and at cp 2 × tp 2; GLM-5's interleaved indexer rope and shared layers in one process; all in one world of 4.
The dense warm-up changes the indexers only (every other tensor bitwise) and lowers their KL; both exports load in
transformers. One process: selection changes the output where index_topk is below the length and nothing where it is
not; decoding with the indexer's key cache equals the whole forward; the scores' memory-light autograd function; the
presets and formulas; the refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave, rotate_half

from helpers.distributed import run_world
from helpers.reference import plain_loop
from test_cli import BASE, launched_alone
from test_deepseek_v3 import perturb
from test_llama_hf import OPTIM, VOCAB, batches, train_from_hf
from test_qwen3_5 import BOUNDARY, PerDocument
from trainer3d.checkpoint.hf import load_hf_checkpoint
from trainer3d.models import plain_model

LR = 1e-3  # selection and routing are discontinuous: test_deepseek_v3's rate
TOPK = 6
COEF = 0.5  # --dsa-loss-coef: not 1, so that a coefficient dropped or applied twice shows


def hf_dsa(kind: str = "v32", seed: int = 0, **overrides):
    """A random DeepseekV32ForCausalLM (or GlmMoeDsaForCausalLM with layers 1 and 3 sharing the selection before
    them), fp32, eager attention (whose probabilities the reference's KL reads): test_deepseek_v3's shape with 4
    indexer heads of 16 dims (8 of them rotated) choosing 6 keys; every weight perturbed, the indexer's projections
    drawn at std 0.3."""
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
              topk_group=2, n_shared_experts=1, first_k_dense_replace=2, q_lora_rank=32, kv_lora_rank=24,
              qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=512,
              routed_scaling_factor=2.5, index_n_heads=4, index_head_dim=16, index_topk=TOPK,
              rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                               "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1,
                               "mscale": 1.0, "mscale_all_dim": 1.0})
    kw.update(overrides)
    torch.manual_seed(seed)
    if kind == "v32":
        model = transformers.DeepseekV32ForCausalLM(transformers.DeepseekV32Config(**kw))
    else:
        model = transformers.GlmMoeDsaForCausalLM(
            transformers.GlmMoeDsaConfig(**kw, indexer_types=["full", "shared", "full", "shared"]))
    model.config._attn_implementation = "eager"
    perturb(model)
    with torch.no_grad():  # peaked index scores: the KL starts near 0.7 and its gradient is a good part of the norm
        for name, p in model.named_parameters():
            if ".indexer." in name and name.endswith(("wq_b.weight", "wk.weight", "weights_proj.weight")):
                p.normal_(std=0.3)
    return model.eval()


class IndexerKL:
    """The indexers' loss of transformers' model, written from the DeepSeek-V3.2 report: each full layer's indexer
    re-run with gradients on its detached inputs (captured by hooks, for every forward since the last call: a packed
    row's documents run one by one), I[s, t] = Σ_h w_h·ReLU(q_h·k_t/√d) over the causal keys, the top-k selection
    (which must be the support of transformers' sparse attention), p the eager attention's probabilities summed over
    heads and L1-normalised, KL(p ‖ softmax(I)) over the selected keys; its mean over queries and indexers."""

    def __init__(self, hf, interleaved: bool, topk: int = TOPK):
        self.seen, self.interleaved, self.topk = {}, interleaved, topk
        self.layers = [layer.self_attn for layer in hf.model.layers if getattr(layer.self_attn, "indexer", None)]
        for attn in self.layers:
            self.seen[attn] = []
            attn.register_forward_pre_hook(self._inputs, with_kwargs=True)
            attn.q_a_layernorm.register_forward_hook(lambda m, i, out, a=attn: self.seen[a][-1].update(q_resid=out))
            attn.register_forward_hook(lambda m, i, out: self.seen[m][-1].update(probs=out[1]))

    def _inputs(self, module, args, kwargs):
        self.seen[module].append(dict(x=kwargs["hidden_states"], rope=kwargs["position_embeddings"]))

    def __call__(self, outputs=None) -> torch.Tensor:
        sums = [self._layer(attn.indexer, **seen) for attn in self.layers for seen in self.seen[attn]]
        queries = sum(n for _, n in sums)
        for attn in self.layers:
            self.seen[attn] = []
        return sum(total for total, _ in sums) / queries

    def _layer(self, idx, x, q_resid, rope, probs) -> tuple[torch.Tensor, int]:
        """(the KL summed over one forward's queries, their count)."""
        x, q_resid, (cos, sin) = x.detach(), q_resid.detach(), rope
        B, S, _ = x.shape
        r, n, d = idx.qk_rope_head_dim, idx.n_heads, idx.head_dim
        q = idx.wq_b(q_resid).view(B, S, n, d)
        k = idx.k_norm(idx.wk(x)).view(B, S, 1, d)
        if self.interleaved:
            q_rot, k_rot = apply_rotary_pos_emb_interleave(q[..., :r], k[..., :r], cos, sin, unsqueeze_dim=2)
        else:
            c, s_ = cos.unsqueeze(2), sin.unsqueeze(2)
            q_rot, k_rot = (t[..., :r] * c + rotate_half(t[..., :r]) * s_ for t in (q, k))
        q, k = torch.cat([q_rot, q[..., r:]], -1), torch.cat([k_rot, k[..., r:]], -1)[:, :, 0]
        w = idx.weights_proj(x) * n ** -0.5
        scores = torch.einsum("bsh,bsht->bst", w, F.relu(torch.einsum("bshd,btd->bsht", q, k) * d ** -0.5))
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        chosen = torch.zeros_like(causal).expand(B, S, S).clone()
        chosen.scatter_(-1, scores.detach().topk(min(self.topk, S), dim=-1).indices, True)
        chosen &= causal
        p = probs.detach().sum(1) / probs.shape[1]
        assert torch.equal(p > 0, chosen), "transformers' sparse attention reads other keys than the selection"
        log_q = scores.masked_fill(~chosen, float("-inf")).log_softmax(-1).masked_fill(~chosen, 0.0)
        return (p * (torch.where(p > 0, p, 1.0).log() - log_q)).sum(), B * S


def reference(hf, interleaved: bool, data: torch.Tensor, coef: float = COEF, per_document: bool = False):
    """The plain loop's (losses, norms, indexer KLs): its loss is the cross-entropy plus coef × the KL;
    `per_document`: each document of a row run alone (test_qwen3_5.PerDocument, the reference of --document-mask)."""
    kl = IndexerKL(hf, interleaved)
    kls = []

    def aux(outputs):
        value = kl()
        kls.append(value.item())
        return coef * value

    losses, norms = plain_loop(PerDocument(hf) if per_document else hf, data, lr=LR,
                               warmup_steps=OPTIM["warmup_steps"], max_steps=OPTIM["max_steps"],
                               grad_clip=OPTIM["grad_clip"], weight_decay=OPTIM["weight_decay"], aux_loss=aux)
    return losses, norms, kls


# tp2 sp: the indexer reads the whole sequence (its detached inputs all-gathered) and keeps whole gradients
SPARSE = {"1x1x1": {}, "tp2": dict(tp=2), "tp2 sp": dict(tp=2, sequence_parallel=True),
          "pp2 recompute full": dict(pp=2, recompute="full"), "cp2": dict(cp=2),
          "compile": dict(compile=True),  # the indexer, its scores and KL functions, top-k and the mask, compiled
          "dp2 ep2": dict(dp=2, ep=2),
          # ZeRO-3: every parameter partitioned, the indexer's too (its modules gathered where they are called)
          "zero3 dp4 ep2": dict(dp=4, ep=2, deepspeed_config="ds_configs/zero3.json")}
DOCUMENTS = {"docs 1x1x1": {}, "docs cp2 tp2": dict(cp=2, tp=2),  # --document-mask
             "docs cp2 tp2 sp": dict(cp=2, tp=2, sequence_parallel=True)}


def document_batches() -> torch.Tensor:
    """batches() with documents: end-of-text tokens inside every row, at other places in odd and even rows."""
    data = batches().clone()
    data[:, 0::2, [7, 19]] = BOUNDARY
    data[:, 1::2, 24] = BOUNDARY
    return data


def _world(rank, world_size, v32_dir, glm_dir, docs_dir, data, out_dir):
    flags = {"lr": LR, "dsa_loss_coef": COEF}
    out = {label: train_from_hf(v32_dir, {**flags, **layout}, data) for label, layout in SPARSE.items()}
    out.update({label: train_from_hf(docs_dir, {**flags, "document_mask": True, **layout}, document_batches(),
                                     boundary=BOUNDARY) for label, layout in DOCUMENTS.items()})
    out["glm 1x1x1"] = train_from_hf(glm_dir, flags, data, out_dir=out_dir + "_glm")
    # the shared layers' recomputation reads its own micro-batch's selection (GPipe: both forwards before a backward)
    out["glm recompute full gpipe"] = train_from_hf(glm_dir, {**flags, "recompute": "full", "schedule": "gpipe"},
                                                    data)
    out["warmup dp2"] = train_from_hf(v32_dir, {**flags, "dsa_stage": "warmup", "dp": 2, "lr": 1e-2}, data,
                                      out_dir=out_dir)
    return out


def _rel(ours: list[float], theirs: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(ours, theirs))


def test_trains_like_transformers_with_the_reports_indexer_loss(tmp_path):
    from trainer3d.checkpoint.load import Checkpoint

    data = batches()
    refs = {}
    for kind in ("v32", "glm"):
        hf = hf_dsa(kind)
        hf.save_pretrained(tmp_path / kind)
        refs[kind] = reference(hf, kind == "glm", data)
    # each document alone is a shorter row, for which topk may order exact ties otherwise (indexer.select): with 32
    # indexer heads no key scores exactly 0
    docs = hf_dsa("v32", index_n_heads=32)
    docs.save_pretrained(tmp_path / "docs")
    refs["docs"] = reference(docs, False, document_batches(), per_document=True)
    dirs = [str(tmp_path / name) for name in ("v32", "glm", "docs", "warm")]
    results = run_world(4, _world, *dirs[:3], data, dirs[3], timeout=900)[0]
    for label, run in results.items():
        if label.startswith("warmup"):
            continue
        losses, norms, kls = refs[label.split()[0] if label.startswith(("glm", "docs")) else "v32"]
        ours = [x + COEF * i for x, i in zip(run["losses"], run["indexer"])]
        print(f"{label}: loss rel diff {_rel(ours, losses):.1e}, norm {_rel(run['norms'], norms):.1e}, "
              f"indexer KL {_rel(run['indexer'], kls):.1e}")
        assert _rel(ours, losses) < 1e-5 and _rel(run["norms"], norms) < 1e-5, (label, run, losses, norms)
        assert _rel(run["indexer"], kls) < 1e-5, (label, run["indexer"], kls)
    assert refs["v32"][0][-1] < refs["v32"][0][0] - 0.05 and max(refs["v32"][1]) > OPTIM["grad_clip"]

    warm = results["warmup dp2"]
    assert warm["indexer"][-1] < warm["indexer"][0] * 0.9, warm["indexer"]  # the indexers learn
    before = transformers.DeepseekV32ForCausalLM.from_pretrained(tmp_path / "v32").state_dict()
    after = Checkpoint(warm["path"]).model_state()
    # ... and nothing else moves (names: our canonical ones carry no "model." and fuse gate|up; compare what maps 1:1)
    changed = {k for k, v in after.items() if ("model." + k) in before and not torch.equal(v.float(),
                                                                                           before["model." + k])}
    assert changed and all(".indexer." in k for k in changed), sorted(changed)
    assert {k for k in after if ".indexer." in k} == changed  # every indexer tensor trained
    print(f"warm-up at dp 2: indexer KL {warm['indexer'][0]:.3f} -> {warm['indexer'][-1]:.3f}; {len(changed)} "
          "indexer tensors moved, every other tensor bitwise")
    for label, kind in (("warmup dp2", "v32"), ("glm 1x1x1", "glm")):
        _exports_like_transformers(results[label]["path"], tmp_path / f"export_{kind}", kind)


def _exports_like_transformers(path: str, out, kind: str) -> None:
    """The export is the architecture it came from (GLM-5's shared layers kept) and transformers' logits on it are
    trainer3d's."""
    from trainer3d.export import main as export_main

    assert export_main([path, str(out), "--tokenizer", "none"]) == 0
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(theirs).__name__ == {"v32": "DeepseekV32ForCausalLM", "glm": "GlmMoeDsaForCausalLM"}[kind]
    cfg, state = load_hf_checkpoint(out)
    assert cfg.sparse and cfg.index_shared == ((False, True, False, True) if kind == "glm" else ())
    x = batches(1)[0, :2, :-1]
    with torch.no_grad():
        diff = (plain_model(cfg, state, torch.device("cpu"), torch.float32)(x) - theirs(x).logits).abs().max()
    assert diff < 1e-5, diff


def _ours(kind: str, tmp_path, hf_overrides: dict | None = None, **change):
    hf_dsa(kind, **(hf_overrides or {})).save_pretrained(tmp_path / kind)
    cfg, state = load_hf_checkpoint(tmp_path / kind)
    cfg = dataclasses.replace(cfg, **change)
    if not cfg.sparse:
        state = {k: v for k, v in state.items() if ".indexer." not in k}
    return plain_model(cfg, state, torch.device("cpu"), torch.float32)


def test_selection_matters_and_only_below_the_length(tmp_path):
    """Guards: with index_topk below the length the output is not dense MLA's (the selection is applied), and with
    index_topk at or above it, it is dense MLA's to rounding (every visible key selected; dense blocks only, whose
    output rounding cannot flip a router's choice)."""
    x = batches(1)[0, :2, :-1]
    dense_blocks = {"first_k_dense_replace": 4}
    with torch.no_grad():
        dense = _ours("v32", tmp_path, dense_blocks, index_n_heads=0)(x)
        sparse = _ours("v32", tmp_path, dense_blocks)(x)
        whole = _ours("v32", tmp_path, dense_blocks, index_topk=x.shape[1])(x)
    assert (sparse - dense).abs().max() > 0.05
    torch.testing.assert_close(whole, dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["v32", "glm"])
def test_decoding_keeps_the_indexer_keys_and_equals_the_whole_forward(tmp_path, kind):
    """Guards: the indexer's keys are cached beside MLA's latent, so a prefill then token-by-token decoding selects
    what the whole sequence's forward selects (GLM-5's shared layers included): the same logits everywhere. With
    32 indexer heads, as published models have, so that no key scores exactly 0 (ties: indexer.select)."""
    from trainer3d.models.attention import KVCache

    model = _ours(kind, tmp_path, {"index_n_heads": 32})
    ids = batches(1)[0, :2, :20]
    with torch.no_grad():
        whole = model(ids)
        cache = KVCache(max_len=20)
        steps = [model(ids[:, :9], cache)] + [model(ids[:, t:t + 1], cache) for t in range(9, 20)]
    assert cache.states[("indexer", 0)].shape == (2, 1, 20, 16)
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=1e-5, atol=1e-5)


def test_dsa_flags_and_layouts_are_refused_before_any_process_group(monkeypatch, capsys):
    """Guards: DSA's flags on a model without indexers, the warm-up under DeepSpeed or with no loss to train on: one
    sentence and exit 2, before any process group."""
    from trainer3d.train.loop import main

    launched_alone(monkeypatch, 2)
    tiny = ["--model", "deepseek-v3.2-tiny"]
    for flags, says in (
            (["--dsa-stage", "warmup"], "--dsa-stage applies to DeepSeek Sparse Attention"),
            (tiny + ["--dsa-stage", "warmup", "--dsa-loss-coef", "0"], "leaves nothing to train"),
            (tiny + ["--dsa-loss-coef", "-1"], "--dsa-loss-coef must be at least 0.0 (got -1.0).")):
        assert main(BASE + flags) == 2, flags
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err and says in err, err


def test_presets_and_formulas():
    """Guards: the DSA presets have their published sizes (GLM-5: 744B total, about 40B active), an indexer's
    parameters are what the model builds, and the FLOPs count attention over the top-k keys plus the indexer's
    scores over every key."""
    from trainer3d.models import MODEL_PRESETS, build_model

    glm = MODEL_PRESETS["glm-5"]
    assert abs(glm.num_params() / 744e9 - 1) < 0.01 and 39e9 < glm.num_params(active=True) < 43e9
    tiny = MODEL_PRESETS["deepseek-v3.2-tiny"]
    with torch.device("meta"):
        model = build_model(tiny)
    assert sum(p.numel() for p in model.parameters()) == tiny.num_params()
    built = sum(p.numel() for n, p in model.named_parameters() if ".indexer." in n)
    assert built == tiny.n_indexers * tiny.indexer_params() and built > 0
    dense = dataclasses.replace(tiny, index_n_heads=0)
    for T in (32, 4096):  # below and above index_topk (64)
        extra = tiny.flops_per_token(T) - dense.flops_per_token(T)
        attention = 6 * tiny.n_layer * tiny.n_head * (tiny.qk_head_dim + tiny.v_head_dim) * (min(T, 64) - T)
        indexer = 6 * tiny.n_layer * (tiny.indexer_params() - 2 * tiny.index_head_dim + 4 * 16 * T)
        assert abs(extra - attention - indexer) < 1e-6 * tiny.flops_per_token(T), (T, extra, attention, indexer)


def test_index_scores_keep_no_per_head_scores_and_have_their_gradient():
    """Guards: the indexer's scores (a head at a time, recomputed in the backward) are Σ_h w_h·ReLU(q_h·kᵀ/√d), −inf
    where not visible, with that formula's gradient (torch.autograd.gradcheck in float64), and the backward keeps only
    q, k, w and the caller's mask itself (no mask of its own)."""
    from trainer3d.models.deepseek_v3.indexer import _IndexScores

    torch.manual_seed(0)
    q, k, w = (torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in ((2, 3, 5, 4), (2, 1, 7, 4),
                                                                                   (2, 5, 3)))
    visible = torch.rand(2, 5, 7) > 0.3

    def finite(q, k, w):  # (gradcheck's differences need finite outputs)
        return _IndexScores.apply(q, k, w, visible, 0.5).masked_fill(~visible, 0.0)

    assert torch.autograd.gradcheck(finite, (q, k, w))
    out = _IndexScores.apply(q, k, w, visible, 0.5)
    want = torch.einsum("btn,bnts->bts", w, F.relu(q @ k.transpose(-1, -2) * 0.5)).masked_fill(~visible, -torch.inf)
    torch.testing.assert_close(out, want)
    saved = out.grad_fn.saved_tensors
    assert [t.shape for t in saved] == [q.shape, k.shape, w.shape, visible.shape] and saved[3] is visible


def test_indexer_kl_keeps_one_tensor_and_has_autograds_gradient():
    """The indexer's KL(p ‖ softmax(I)) over the allowed keys, per query: the value and the gradient autograd gives the
    formula written here (p summing to 1, and to 0.7: the gradient's general form), keeping one [B, T, S] tensor."""
    from trainer3d.models.deepseek_v3.indexer import kl_per_query

    torch.manual_seed(1)
    allowed = torch.rand(2, 5, 7) > 0.4
    allowed[..., 0] = True
    for mass in (1.0, 0.7):
        p = torch.rand(2, 5, 7, dtype=torch.float64).masked_fill(~allowed, 0.0)
        p = p / p.sum(-1, keepdim=True) * mass
        scores = torch.randn(2, 5, 7, dtype=torch.float64).masked_fill(~allowed, -torch.inf).requires_grad_(True)
        grad = torch.randn(2, 5, dtype=torch.float64)
        ours = kl_per_query(p, scores, allowed)
        assert [t.shape for t in ours.grad_fn.saved_tensors] == [p.shape]
        (mine,) = torch.autograd.grad(ours, scores, grad)
        log_q = scores.masked_fill(~allowed, -torch.inf).log_softmax(-1).masked_fill(~allowed, 0.0)
        theirs = (p * (torch.where(p > 0, p, 1.0).log() - log_q)).sum(-1)
        (want,) = torch.autograd.grad(theirs, scores, grad)
        torch.testing.assert_close(ours, theirs)
        torch.testing.assert_close(mine, want)


@pytest.mark.parametrize("shared", [False, True])
def test_the_planner_counts_what_a_sparse_block_keeps_per_query_key_pair(shared):
    """Measured (CPU, bf16 autocast, the tensors autograd keeps; tests/test_plan.py's measure): the [T, S] tensors a
    sparse block keeps for its backward, per (query, key) pair, are what the planner's LayerActivations say: 7 bytes
    with an indexer of its own (the loss's gradient direction in fp32, the scores' visible mask, the attention's
    mask in bf16), 2 in a layer sharing another's selection (GLM-5's). Until 2026-12-07 the planner counted none, and
    the block kept 12.4 bytes (the KL's autograd: log q, p and two masks)."""
    from test_plan import _saved_bytes
    from trainer3d.models import MODEL_PRESETS, build_model
    from trainer3d.plan.candidate import PRECISIONS

    T = 120  # (no other dimension of the tiny model: 96 is o_proj's input)
    cfg = dataclasses.replace(MODEL_PRESETS["deepseek-v3.2-tiny"], n_layer=2, first_k_dense_replace=2,
                              index_shared=(False, True))
    torch.manual_seed(0)
    model = build_model(cfg)
    model.init_tables(torch.device("cpu"))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    model.train()
    attention = [model.blocks[i].self_attn for i in "01"]
    selections = {}
    for a in attention:
        a.observer, a.selections, a.source = _Observer(), selections, 0
    x = torch.randn(1, T, cfg.n_embd, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        attention[0](model.blocks["0"].input_layernorm(x))  # (the shared layer reads layer 0's selection)
    block = model.blocks["1" if shared else "0"]
    pairs = _saved_bytes(block, x, keep=lambda t: tuple(t.shape[-2:]) == (T, T)) / T ** 2
    A = cfg.layer_activations()
    planned = A.pair_matmul * PRECISIONS["bf16-autocast"].matmul + (0 if shared else 5)
    assert pairs == planned == (2 if shared else 7), pairs
    assert A.pair_bytes == 5 * 1 / 2  # one layer of two has an indexer of its own


class _Observer:
    """IndexerLoss's part in a plain block (no tp: the probabilities are this process's; the KL joins the output)."""

    @staticmethod
    def over_heads(probs):
        return probs

    @staticmethod
    def attach(out, kl):
        return out + 0 * kl.sum()
