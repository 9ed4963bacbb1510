"""The dropout RNG contract under tensor parallelism (Megatron's RNG tracker): dropout on replicated
activations draws the same mask on every tp rank (else the replicas of the residual stream drift apart),
dropout on head-sharded attention probabilities draws a different mask on each. Under --compile too: inductor's
dropout seeds come from the default generator (alike on tp peers); the head-sharded core runs eagerly on its stream."""

from __future__ import annotations

import pytest
import torch

from helpers.distributed import run_world
from trainer3d.config import TrainConfig
from trainer3d.train.setup import validate
from trainer3d.train.trainer import Trainer


def _dropout_streams(rank, world_size, compile_blocks):
    cfg = TrainConfig(model="tiny", n_layer=2, vocab_size=300, tp=2, dropout=0.2, seq_len=16, global_batch=2,
                      compile=compile_blocks)
    setup = validate(cfg, world_size, 300)
    topo = setup.topology()
    trainer = Trainer(setup, topo, torch.device("cpu"), cfg.model_config(300))
    model = trainer.parallel_model.stages[0]
    model.train()
    hidden = {}
    model.h["1"].register_forward_hook(lambda m, i, o: hidden.setdefault("h1", o.detach().clone()))
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    model(ids)
    attn = model.h["0"].attn
    with attn.sharded_rng():
        sharded = torch.rand(64)
    replicated = torch.rand(64)
    topo.destroy()
    return {"hidden": hidden["h1"], "sharded": sharded, "replicated": replicated}


@pytest.mark.parametrize("compile_blocks", [False, True], ids=["eager", "compile"])
def test_dropout_masks_follow_the_tp_contract(compile_blocks):
    r0, r1 = run_world(2, _dropout_streams, compile_blocks, timeout=300)
    # replicated stream: identical draws, hence identical residual streams after two dropout-heavy blocks
    assert torch.equal(r0["replicated"], r1["replicated"])
    assert torch.equal(r0["hidden"], r1["hidden"])
    # sharded stream: independent per tp rank
    assert not torch.equal(r0["sharded"], r1["sharded"])
