"""Shared by the parity tests: train one layout for a few steps on synthetic data, inside a spawned world."""

from __future__ import annotations

import torch

from trainer3d.config import TrainConfig
from trainer3d.train.setup import validate
from trainer3d.models import canonical_name
from trainer3d.parallel.engine import is_tied_duplicate
from trainer3d.parallel.parallelize import gather_stage_params
from trainer3d.parallel.tensor_parallel import gather_full
from trainer3d.train.trainer import Trainer

VOCAB = 500
SEQ = 32
GLOBAL_BATCH = 16


# The Llama parity model: grouped-query attention (8 query heads on 4 kv heads: tp 2 and 4 shard whole kv groups),
# rotary positions with Llama 3.1's rescaling, SwiGLU, the untied head; the rest as parity_config's.
LLAMA = dict(model="llama-tiny", n_kv_heads=4, ffn_hidden=160)


def parity_config(**layout) -> TrainConfig:
    """fp32, dropout 0, clipping active (grad norms here are 1-3), 8 blocks and 8 heads so that tp and pp up
    to 8 are valid. GPT-2 unless the layout names another model (LLAMA)."""
    base = dict(
        model="tiny", n_layer=8, n_head=8, n_embd=64, vocab_size=VOCAB, seq_len=SEQ, global_batch=GLOBAL_BATCH,
        lr=3e-3, warmup_steps=3, max_steps=10, grad_clip=0.5, precision="fp32", seed=1234,
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


def train_layout(world_size: int, layout: dict, steps: int) -> dict | None:
    """Run on every rank of the world (group creation is collective); ranks outside the layout idle.
    Returns, on active ranks: the per-step losses, and on tp rank 0 of dp replica 0 the full values of its
    stages' parameters (plus the last stage's copy of the tied embedding)."""
    layout = dict(layout)
    boundary = layout.pop("boundary", None)  # the token opening a document (document masking), also in the data
    n = layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1) * layout.pop("dp", 1)
    cfg = parity_config(**layout)
    setup = validate(cfg, n, VOCAB)
    cfg_layout, plan = setup.layout, setup.plan
    topo = setup.topology(list(range(n)))
    result = None
    if topo.active:
        trainer = Trainer(setup, topo, torch.device("cpu"), cfg.model_config(VOCAB), boundary=boundary)
        per = plan.global_batch // cfg_layout.dp
        losses, norms = [], []
        for batch in global_batches(steps, boundary):
            rec = trainer.train_step(batch[topo.dp_rank * per : (topo.dp_rank + 1) * per])
            losses.append(rec["loss"])
            norms.append(rec["grad_norm"])
        params = gather_stage_params(trainer.pm, topo)
        head_copy = {}  # a last stage's copy of a tied embedding, under the embedding's name
        for m in trainer.pm.stages:
            if m.head is not None and is_tied_duplicate(m, m.head.weight):
                w = m.head.weight
                head_copy[canonical_name(m.cfg, f"{m.HEAD}.weight")] = gather_full(w.data, w.tp_spec, topo.tp_group)
        result = {"losses": losses, "grad_norms": norms, "coords": (topo.pp_rank, topo.dp_rank, topo.tp_rank)}
        if topo.tp_rank == 0 and topo.dp_rank == 0:
            result.update(params=params, head_copy=head_copy)
    topo.destroy()
    return result


def run_layouts(rank: int, world_size: int, layouts: list[dict], steps: int, reference: dict | None = None) -> list:
    """The reference (one process, on rank 0; `reference`: its model flags, e.g. LLAMA) first, then every layout, all
    in this one world."""
    out = [train_layout(world_size, dict(reference or {}), steps)]
    for layout in layouts:
        out.append(train_layout(world_size, layout, steps))
    return out
