"""Shared by the parity tests: train one layout for a few steps on synthetic data, inside a spawned world, and compare
it with the one-process run (`check`), within the tolerances stated here once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer3d.config import TrainConfig
from trainer3d.data.batch import Batch
from trainer3d.train.setup import validate
from trainer3d.models import MODEL_PRESETS, canonical_name
from trainer3d.parallel.engine import is_tied_duplicate
from trainer3d.parallel.parallelize import gather_stage_params
from trainer3d.parallel.shards import gather_full
from trainer3d.train.trainer import Trainer

VOCAB = 500
SEQ = 32
GLOBAL_BATCH = 16

# THE parity tolerances (README and docs/parity.md quote them): every layout and feature against the one-process run,
# fp32, same seed and data. The gradient norm is compared because AdamW normalizes a constant gradient scale away: a
# doubled gradient (a missing 1/dp or 1/micro-batches) moves neither the loss nor the parameters past their bounds
# (test_parity.py::test_the_check_catches_a_gradient_scale_error).
LOSS_RTOL = 1e-5  # per-step loss, relative
NORM_RTOL = 1e-5  # per-step global gradient norm (before clipping), relative
PARAM_ATOL = 1e-4  # final parameters, absolute (weights of order 0.02-1)


# The Llama parity model: grouped-query attention (8 query heads on 4 kv heads: tp 2 and 4 shard whole kv groups),
# rotary positions with Llama 3.1's rescaling, SwiGLU, the untied head; the rest as parity_config's.
LLAMA = dict(model="llama-tiny", n_kv_heads=4, ffn_hidden=160)
# The mixture-of-experts parity model: Qwen3-MoE's parts (q/k norms, head_dim 48 != 64/8), block 0 dense and blocks
# 1-7 of 8 experts, top-2 renormalized; the rest as parity_config's but lr 3e-4: routing is discontinuous, and at
# 1e-3 the rounding differences of a layout move a near-tie token's second expert within a few steps (an expert's
# parameters then differ by 1e-3 while the loss stays within 5e-7); at 3e-4 every norm agrees to 1e-6.
MOE = dict(model="qwen3-moe-tiny", n_kv_heads=4, ffn_hidden=160, lr=3e-4)
# ... with the balancing losses on: the per-sequence aux loss and the z-loss. (Loss-free balancing's bias is refused
# on Qwen3-MoE's softmax scores; its layouts are a sigmoid-scored family's to prove: DeepSeek-V3's tiny preset.)
MOE_BALANCED = dict(MOE, moe_aux_loss_coef=0.01, moe_z_loss_coef=0.001)
# ... with the global-batch balance loss instead (the loads of every dp rank's micro-batch)
MOE_GLOBAL = dict(MOE_BALANCED, moe_aux_loss="global")
MODEL_FLAGS = ("model", "n_kv_heads", "ffn_hidden", "lr", "moe_aux_loss_coef", "moe_aux_loss", "moe_z_loss_coef",
               "moe_bias_update_rate", "sft")


def parity_config(**layout) -> TrainConfig:
    """fp32, dropout 0, clipping active (grad norms here are 0.6-1.4), 8 blocks and 8 heads so that tp and pp up
    to 8 are valid. GPT-2 unless the layout names another model (LLAMA). lr 1e-3: at 3e-3 this random-data model's
    10-step trajectory amplifies rounding (the first step's norm agrees to 1e-8 at every layout, the tenth's only to
    8e-5 for Llama, while the losses stay within 2e-7), which would hide a real discrepancy under that noise."""
    base = dict(
        model="tiny", n_layer=8, n_head=8, n_embd=64, vocab_size=VOCAB, seq_len=SEQ, global_batch=GLOBAL_BATCH,
        lr=1e-3, warmup_steps=3, max_steps=10, grad_clip=0.5, precision="fp32", seed=1234,
    )
    base.update(layout)
    return TrainConfig(**base)


def global_batches(steps: int, boundary: int | None = None) -> torch.Tensor:
    """Random tokens; with `boundary`, about one token in 7 is that token, so rows pack documents of a few tokens."""
    g = torch.Generator().manual_seed(99)
    batches = torch.randint(0, VOCAB, (steps, GLOBAL_BATCH, SEQ + 1), generator=g)
    if boundary is not None:
        batches[batches % 7 == 3] = boundary
    return batches


# Supervised fine-tuning's rows (`sft` in a layout): every row holds two conversations of random lengths and the rest is
# padding (each row's length says where it starts, as the chat rows' do: a mixture of experts counts none of it); a
# conversation's targets are supervised in random runs (never its first token), so the supervised counts
# differ between rows, micro-batches and dp ranks. "packed": 16 such rows a step, attention and positions per
# conversation (what --data-format chat does); "unpacked": the same conversations one per row (32 rows, --no-pack).
SFT = {"packed": dict(document_mask=True, reset_position_ids=True), "unpacked": dict(global_batch=2 * GLOBAL_BATCH)}


def chat_batches(steps: int, packed: bool) -> list[Batch]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
        runs = torch.rand(GLOBAL_BATCH, SEQ + 1, generator=g) < 0.5
        flags = runs & torch.roll(runs, 1, 1)  # runs of supervised tokens
        docs = torch.full((GLOBAL_BATCH, SEQ + 1), 2)
        ends = []
        for r in range(GLOBAL_BATCH):
            a = int(torch.randint(4, 21, (1,), generator=g))
            b = a + int(torch.randint(4, SEQ + 2 - a, (1,), generator=g))
            docs[r, :a], docs[r, a:b] = 0, 1
            ends.append((a, b))
        flags &= docs < 2
        flags[(docs != torch.roll(docs, 1, 1)) | (torch.arange(SEQ + 1) == 0)] = False  # a conversation's first token
        if packed:
            lengths = torch.tensor([b for _, b in ends])
            out.append(Batch(tokens, flags[:, 1:], docs, int(flags[:, 1:].sum()), _inputs(lengths), lengths))
            continue
        rows = torch.zeros(2 * GLOBAL_BATCH, SEQ + 1, dtype=torch.long)
        kept = torch.zeros(2 * GLOBAL_BATCH, SEQ + 1, dtype=torch.bool)
        for r, (a, b) in enumerate(ends):
            rows[2 * r, :a], kept[2 * r, :a] = tokens[r, :a], flags[r, :a]
            rows[2 * r + 1, : b - a], kept[2 * r + 1, : b - a] = tokens[r, a:b], flags[r, a:b]
        lengths = torch.tensor([n for a, b in ends for n in (a, b - a)])
        out.append(Batch(rows, kept[:, 1:], None, int(kept[:, 1:].sum()), _inputs(lengths), lengths))
    return out


def _inputs(lengths: torch.Tensor) -> int:
    """A global batch's real input tokens (data/batch.py's input_count: a row of L tokens feeds min(L, SEQ))."""
    return int(lengths.clamp(max=SEQ).sum())


def step_batches(steps: int, boundary: int | None = None, sft: str | None = None) -> list:
    """The global batches of a parity run: token rows, or (`sft`) Batches of chat rows."""
    return chat_batches(steps, sft == "packed") if sft else list(global_batches(steps, boundary))


def rows_of(batch, dp_rank: int, per: int):
    """A dp rank's rows of a global batch (its supervised and input counts stay the global batch's)."""
    mine = slice(dp_rank * per, (dp_rank + 1) * per)
    if not isinstance(batch, Batch):
        return batch[mine]
    docs = batch.documents[mine] if batch.documents is not None else None
    lengths = batch.lengths[mine] if batch.lengths is not None else None
    return Batch(batch.tokens[mine], batch.supervised[mine], docs, batch.targets, batch.inputs, lengths)


def train_layout(world_size: int, layout: dict, steps: int) -> dict | None:
    """Run on every rank of the world (group creation is collective); ranks outside the layout idle.
    Returns, on active ranks: the per-step losses, and on tp rank 0 of dp replica 0 the full values of its
    stages' parameters (plus the last stage's copy of the tied embedding)."""
    layout = dict(layout)
    boundary = layout.pop("boundary", None)  # the token opening a document (document masking), also in the data
    # an injected bug: every gradient multiplied by this before the norm and the step (2: a missing 1/dp at dp 2)
    scale_error = layout.pop("grad_scale_error", None)
    sft = layout.pop("sft", None)
    if sft == "packed":
        boundary = VOCAB  # a token that never occurs: the documents come with the rows

    slow_rank = layout.pop("slow_rank", None)  # this rank reports SLOW_S of batch fetch each step: a straggler
    # --layout auto: the planner picks for `world` processes (the other axes given are its constraints)
    world = layout.pop("world", None)
    n = world or layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1) * layout.pop("dp", 1)
    cfg = parity_config(**layout, **SFT.get(sft, {}))
    setup = validate(cfg, n, VOCAB)
    cfg_layout, plan = setup.layout, setup.plan
    topo = setup.topology(list(range(n)))
    result = None
    if topo.active:
        trainer = Trainer(setup, topo, torch.device("cpu"), cfg.model_config(VOCAB), boundary=boundary)
        if scale_error is not None:
            reduce = trainer.engine.reduce_grads
            trainer.engine.reduce_grads = lambda grad_scale: reduce(grad_scale * scale_error)
        per = plan.global_batch // cfg_layout.dp
        losses, norms, times = [], [], []
        watch = FeatureWatch(trainer, dtypes=cfg.precision != "fp32", compiled=cfg.compile)
        slow = SLOW_S if slow_rank == topo.rank else 0.0  # a slow input pipeline: the batch's fetch time it reports
        for batch in step_batches(steps, boundary, sft):
            rec = trainer.train_step(rows_of(batch, topo.dp_rank, per), data_s=slow)
            losses.append(rec["loss"])
            norms.append(rec["grad_norm"])
            times.append(rec["rank_step_times"])
            watch.stop()
        params = gather_stage_params(trainer.parallel_model, topo)
        head_copy = {}  # a last stage's copy of a tied embedding, under the embedding's name
        for m in trainer.parallel_model.stages:
            if m.head is not None and is_tied_duplicate(m, m.head.weight):
                w = m.head.weight
                head_copy[canonical_name(m.cfg, f"{m.HEAD}.weight")] = gather_full(w.data, w.tp_spec, topo.tp_group)
        # the routers' biases
        tables = {k: v.clone() for m in trainer.parallel_model.stages for k, v in m.state_tables().items()}
        result = {"losses": losses, "grad_norms": norms, "coords": (topo.pp_rank, topo.dp_rank, topo.tp_rank),
                  "dtypes": watch.dtypes, "compiled_graphs": watch.graphs, "tables": tables, "rank_step_times": times,
                  "resolved": resolved_layout(setup), "layout_choice": setup.cfg.layout_choice,
                  "loss_graphs": loss_graphs()}
        if topo.tp_rank == 0 and topo.dp_rank == 0:
            result.update(params=params, head_copy=head_copy)
    topo.destroy()
    return result


# A slowed rank's batch fetch, in seconds, as the loop would time it (train_step's data_s, part of the rank's own work):
# a forward of the parity model takes 5-40 ms on 2 shared cores, 0.16 s at worst seen under the whole suite's load
SLOW_S = 5.0


def resolved_layout(setup) -> dict:
    """The layout a run trained at (under --layout auto: the planner's pick), as a case of test_parity."""
    cfg, L = setup.cfg, setup.layout
    out = dict(dp=L.dp, tp=L.tp, pp=L.pp, schedule=cfg.schedule, virtual_stages=cfg.virtual_stages,
               micro_batches=setup.plan.micro_batches)
    extra = dict(cp=(L.cp, 1), ep=(L.ep, 1), recompute=(cfg.recompute, "none"),
                 sequence_parallel=(cfg.sequence_parallel, False))
    return {**out, **{k: v for k, (v, default) in extra.items() if v != default}}


def as_trained(results: list, cases: list[dict]) -> list[dict]:
    """`cases` with each --layout auto case replaced by the layout its run trained at (the reference is first in
    `results`' rows), still marked layout=auto: what check and label compare and print."""
    out = []
    for i, c in enumerate(cases, start=1):
        if c.get("layout") == "auto":
            run = next(r[i] for r in results if r[i] is not None)
            c = {**{k: v for k, v in c.items() if k not in ("world", "slow_rank")}, **run["resolved"]}
        out.append(c)
    return out


def loss_graphs() -> int:
    """The graphs dynamo holds in this process for the loss's chunk passes (--compile compiles them): the fewer of the
    forward's statistics' and the backward's scaling's, so that both must have run compiled to count."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from trainer3d.parallel.cross_entropy import _chunk_stats, _scale_chunk

    return min(len(_debug_get_cache_entry_list(f.__code__)) for f in (_chunk_stats, _scale_chunk))


class FeatureWatch:
    """Evidence, from the first step, that a feature acted rather than silently doing nothing: the dtypes the
    stages' modules computed in (forward hooks; `dtypes`) and the graphs dynamo compiled (its counters; `compiled`)."""

    def __init__(self, trainer, dtypes: bool, compiled: bool):
        from torch._dynamo.utils import counters

        self.counters, self.dtypes, self.graphs = counters, set(), 0
        self.graphs_before = counters["stats"]["unique_graphs"] if compiled else None
        self.hooks = [m.register_forward_hook(self._record) for s in trainer.parallel_model.stages for m in s.modules()
                      if dtypes and next(m.children(), None) is None]  # leaves: linears, norms, embeddings

    def _record(self, module, args, out):
        if torch.is_tensor(out) and out.is_floating_point():
            self.dtypes.add(str(out.dtype).removeprefix("torch."))

    def stop(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []
        if self.graphs_before is not None:
            self.graphs = self.counters["stats"]["unique_graphs"] - self.graphs_before
            self.graphs_before = None


def run_groups(rank: int, world_size: int, groups: list, steps: int) -> list:
    """Several (reference flags, layouts) groups in one world: run_layouts of each."""
    return [run_layouts(rank, world_size, layouts, steps, reference) for reference, layouts in groups]


def run_layouts(rank: int, world_size: int, layouts: list[dict], steps: int, reference: dict | None = None) -> list:
    """The reference (one process, on rank 0; `reference`: its model flags, e.g. LLAMA) first, then every layout, all
    in this one world."""
    out = [train_layout(world_size, dict(reference or {}), steps)]
    for layout in layouts:
        out.append(train_layout(world_size, layout, steps))
    return out


# ---- comparing with the one-process run -------------------------------------------------------------------------------
@dataclass
class Diff:
    """How far one layout's run is from the reference: the largest per-step relative difference of the loss and of
    the gradient norm, the largest absolute difference of a final parameter, and whether the tied copies agree."""

    loss: float
    norm: float
    param: float
    tied_ok: bool
    tables_ok: bool = True  # the routers' selection biases equal the reference's bitwise (integer loads moved them)

    @property
    def ok(self) -> bool:
        return (self.loss <= LOSS_RTOL and self.norm <= NORM_RTOL and self.param <= PARAM_ATOL and self.tied_ok
                and self.tables_ok)

    def __str__(self) -> str:
        return f"loss {self.loss:.1e} grad_norm {self.norm:.1e} param {self.param:.1e}" + (
            "" if self.tied_ok else " tied copies differ") + ("" if self.tables_ok else " selection biases differ")


def max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def compare(per_rank: list[dict], ref: dict, case: dict) -> Diff:
    """`per_rank`: train_layout's results of one layout's active ranks; `ref`: the one-process run's."""
    losses = per_rank[0]["losses"]
    assert all(r["losses"] == losses for r in per_rank), f"{case}: ranks disagree on the loss"
    assert all(r["grad_norms"] == per_rank[0]["grad_norms"] for r in per_rank), f"{case}: ranks disagree on the norm"
    params, head_copies, tables = {}, {}, {}
    for r in per_rank:
        params.update(r.get("params", {}))
        head_copies.update(r.get("head_copy", {}))
        tables.update(r.get("tables", {}))
    assert set(params) == set(ref["params"]), f"{case}: parameters missing after gathering"
    assert set(tables) == set(ref["tables"]), f"{case}: tables missing"
    tables_ok = all(torch.equal(tables[k], ref["tables"][k]) for k in tables)
    tied_ok = all(torch.equal(head_copies[k], params[k]) for k in head_copies)
    untied = not MODEL_PRESETS[case.get("model", "tiny")].tie_embeddings  # the head its own weight: no copy
    if case.get("pp", 1) > 1 and (not head_copies) != untied and case.get("schedule") not in ("zbv", "dualpipev"):
        tied_ok = False  # a last stage without the tied embedding must hold a copy, an untied head none
    return Diff(loss=max_rel(losses, ref["losses"]), norm=max_rel(per_rank[0]["grad_norms"], ref["grad_norms"]),
                param=max((params[k] - ref["params"][k]).abs().max().item() for k in params), tied_ok=tied_ok,
                tables_ok=tables_ok)


def label(c: dict) -> str:
    extra = "".join(f" {k}={v}" for k, v in c.items() if k not in ("dp", "tp", "pp", "schedule", "virtual_stages",
                                                                    "micro_batches", *MODEL_FLAGS))
    extra += f" {c['model']}" if "model" in c else ""
    return f"{c.get('dp', 1)}x{c.get('tp', 1)}x{c.get('pp', 1)} {c.get('schedule', '1f1b'):<16} " \
           f"v={c.get('virtual_stages', 1)}{extra}"


def diffs(results: list, cases: list[dict]) -> list[Diff]:
    """run_layouts' results (per rank: the reference, then each case) -> each case's Diff, printed as a table."""
    ref = results[0][0]
    assert max(ref["grad_norms"]) > 0.5, "clipping (at 0.5) should be active in the reference run"
    out = [compare([r[i] for r in results if r[i] is not None], ref, c) for i, c in enumerate(cases, start=1)]
    print("\n".join(f"{label(c)} {d}" for c, d in zip(cases, out)))
    return out


def check(results: list, cases: list[dict]) -> list[str]:
    """The failures (empty: every case is within the tolerances)."""
    return [f"{c}: {d}" for c, d in zip(cases, diffs(results, cases)) if not d.ok]
