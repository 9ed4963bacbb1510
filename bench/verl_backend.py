"""What verl's backend costs over trainer3d.engine driven directly (docs/post_training.md): verl's loss enters through
its per-token gradient, after a forward pass of its own, so a train_batch runs two forwards and one backward where
forward_backward runs one of each. Times one update (verl: train_batch with its ppo_loss; direct: forward_backward
with the same PPO loss written per token, then step) and one RL step (the old log-probs first: infer_batch /
logprobs), on the same rollouts, at one process; medians of --repeats after a warm-up, as ratios.

    python bench/verl_backend.py [--rollouts 32] [--seq-len 256] [--repeats 3]

verl must be importable: the suite installs it into .cache/verl-site-* (tests/helpers/verl_site.py); this script adds that
folder to the path (or pass --verl-site).
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import tempfile
import time
from functools import partial

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.harness import stamp, table  # noqa: E402


def rollouts(n: int, seq: int, vocab: int):
    """n rollouts: prompts of 16-48 tokens, replies filling up to seq + 1 in all, advantages per rollout."""
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(16, 49, (n,), generator=g)
    replies = torch.randint(8, seq + 1 - 48, (n,), generator=g)
    return [(torch.randint(0, vocab, (int(p) + int(r),), generator=g), int(p)) for p, r in zip(prompts, replies)], \
        torch.randn(n, generator=g)


def ppo_token_loss(logprobs, f, clip=0.2):
    ratio = torch.exp(logprobs - f["old"])
    return -torch.min(ratio * f["adv"], ratio.clamp(1 - clip, 1 + clip) * f["adv"])


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def direct(cfg, seqs, adv, repeats):
    from trainer3d.engine import Engine

    engine = Engine(cfg)
    sequences = [s for s, _ in seqs]
    masks = [torch.arange(len(s) - 1) >= p - 1 for s, p in seqs]

    def update(old):
        engine.forward_backward(sequences, ppo_token_loss, mask=masks, fields={"old": old, "adv": adv.tolist()})
        engine.step()

    old = engine.logprobs(sequences)
    t_update = timed(lambda: update(old), repeats)
    t_step = timed(lambda: update(engine.logprobs(sequences)), repeats)
    engine.close()
    return t_update, t_step


def via_verl(cfg_args, hf_dir, seqs, adv, repeats):
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import ActorConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    from trainer3d.engine.verl_engine import Trainer3dEngineConfig

    engine = EngineRegistry.new(model_type="language_model", backend="trainer3d",
                                model_config=HFModelConfig(path=hf_dir, load_tokenizer=False),
                                engine_config=Trainer3dEngineConfig(args=cfg_args, dtype="float32"),
                                optimizer_config=FSDPOptimizerConfig(lr=1e-5, weight_decay=0.0, total_training_steps=100))
    P = max(p for _, p in seqs)
    R = max(len(s) - p for s, p in seqs)
    ids = torch.zeros(len(seqs), P + R, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for i, (s, p) in enumerate(seqs):  # verl's layout: prompts left-padded, replies right-padded
        ids[i, P - p:P + len(s) - p] = s
        attention[i, P - p:P + len(s) - p] = 1
    batch = {"input_ids": ids, "prompts": ids[:, :P], "attention_mask": attention, "responses": ids[:, P:],
             "response_mask": attention[:, P:], "position_ids": (attention.cumsum(-1) - 1).clamp(min=0)}
    proto = DataProto.from_single_dict(batch, meta_info={"temperature": 1.0})
    budget = {"use_dynamic_bsz": True, "max_token_len_per_gpu": 4 * (P + R)}

    def infer():
        td = left_right_2_no_padding(proto.to_tensordict())
        tu.assign_non_tensor(td, **budget)
        with engine.eval_mode():
            return no_padding_2_padding(engine.infer_batch(td)["model_output"]["log_probs"], td)

    config = ActorConfig(strategy="trainer3d", rollout_n=1, ppo_micro_batch_size_per_gpu=-1)

    def update(old):
        proto.batch["old_log_probs"], proto.batch["advantages"] = old, adv[:, None].expand(-1, R).contiguous()
        td = left_right_2_no_padding(proto.to_tensordict())
        tu.assign_non_tensor(td, **budget, global_batch_size=len(seqs))
        with engine.train_mode():
            engine.train_batch(td, partial(ppo_loss, config=config))

    old = infer()
    t_update = timed(lambda: update(old), repeats)
    t_step = timed(lambda: update(infer()), repeats)
    engine.engine.close()
    return t_update, t_step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rollouts", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--verl-site", default=None)
    args = ap.parse_args(argv)
    site = args.verl_site or next(iter(sorted(glob.glob(os.path.join(ROOT, ".cache", "verl-site-*")))), None)
    if site is None:
        sys.exit("verl is not installed here: run tests/test_verl.py once (it installs it into .cache), or pass "
                 "--verl-site.")
    sys.path.insert(0, site)  # (its pins first: tests/helpers/verl_site.py)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    torch.set_num_threads(1)
    import transformers

    from trainer3d.config import TrainConfig

    torch.manual_seed(0)
    hf = transformers.LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    with tempfile.TemporaryDirectory() as tmp:
        transformers.LlamaForCausalLM(hf).save_pretrained(tmp)
        seqs, adv = rollouts(args.rollouts, args.seq_len, hf.vocab_size)
        flags = ["--seq-len", str(args.seq_len), "--global-batch", "8", "--micro-batches", "2", "--precision", "fp32",
                 "--document-mask", "--reset-position-ids", "--out-dir", os.path.join(tmp, "run")]
        cfg = TrainConfig(init_from_hf=tmp, seq_len=args.seq_len, global_batch=8, micro_batches=2, precision="fp32",
                          lr=1e-5, weight_decay=0.0, document_mask=True, reset_position_ids=True,
                          out_dir=os.path.join(tmp, "direct"))
        d_update, d_step = direct(cfg, seqs, adv, args.repeats)
        v_update, v_step = via_verl(flags, tmp, seqs, adv, args.repeats)
    print(table([["one update (forward_backward + step / train_batch)", f"{d_update:.2f}", f"{v_update:.2f}",
                  f"{v_update / d_update:.2f}x"],
                 ["one RL step (old log-probs, then the update)", f"{d_step:.2f}", f"{v_step:.2f}",
                  f"{v_step / d_step:.2f}x"]],
                ["", "trainer3d.engine s", "verl backend s", "verl / direct"]))
    print(f"{args.rollouts} rollouts of {min(len(s) for s, _ in seqs)}-{max(len(s) for s, _ in seqs)} tokens, "
          f"a {sum(p.numel() for p in transformers.LlamaForCausalLM(hf).parameters()) / 1e6:.1f}M-parameter Llama, "
          f"one process, fp32, medians of {args.repeats}")
    print(stamp("python bench/verl_backend.py " + " ".join(sys.argv[1:] if argv is None else argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
