"""Hugging Face GPT-2 weights loaded at any layout give transformers' logits: one process and tp=2 × pp=2."""

from __future__ import annotations

import torch
import torch.distributed as dist

from helpers.distributed import run_world
from trainer3d.config import TrainConfig
from trainer3d.train.setup import validate
from trainer3d.checkpoint.hf import load_hf_checkpoint
from trainer3d.models import canonical_name
from trainer3d.parallel.shards import from_full
from trainer3d.train.trainer import Trainer


def _logits_at_layouts(rank, world_size, hf_dir, ids):
    gcfg, state = load_hf_checkpoint(hf_dir)
    out = {}
    for tp, pp in [(1, 1), (2, 2)]:
        cfg = TrainConfig(
            model="tiny", n_layer=gcfg.n_layer, n_head=gcfg.n_head, n_embd=gcfg.n_embd, vocab_size=gcfg.vocab_size,
            seq_len=ids.shape[1], global_batch=ids.shape[0], micro_batches=2, tp=tp, pp=pp, precision="fp32",
        )
        setup = validate(cfg, tp * pp, gcfg.vocab_size)
        topo = setup.topology(list(range(tp * pp)))
        if topo.active:
            mcfg = cfg.model_config(gcfg.vocab_size)
            trainer = Trainer(setup, topo, torch.device("cpu"), mcfg,
                              shard_value=from_full(lambda n, s: state[canonical_name(mcfg, n)]))
            for m in trainer.engine.stage_modules:
                m.eval()
            args = (ids,) if trainer.parallel_model.has_first else ()
            kwargs = {"target": ids} if trainer.parallel_model.has_last else {}  # the schedule computes a loss too
            with torch.no_grad():
                local = trainer.schedule.eval(*args, **kwargs)
            if trainer.parallel_model.has_last:
                shards = [torch.empty_like(local) for _ in range(tp)]
                dist.all_gather(shards, local.contiguous(), group=topo.tp_group)
                out[(tp, pp)] = torch.cat(shards, dim=-1)[..., : gcfg.vocab_size]
        topo.destroy()
    return out


def test_hf_weights_give_transformers_logits_at_tp2_pp2(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=4, n_head=4, n_embd=64, n_positions=64, vocab_size=1000,
                                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).eval()
    hf.save_pretrained(tmp_path)
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
    results = run_world(4, _logits_at_layouts, str(tmp_path), ids, timeout=300)
    got = {k: v for r in results for k, v in r.items()}
    assert set(got) == {(1, 1), (2, 2)}
    for layout, logits in got.items():
        diff = (logits - expected).abs().max().item()
        assert diff < 1e-5, f"layout tp,pp={layout}: max logit diff {diff:.2e}"
