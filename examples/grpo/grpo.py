"""GRPO on trainer3d.engine: a complete loop, small enough for a CPU, at any layout.

    python examples/grpo/grpo.py --steps 200 --out-dir runs/grpo                     # one process
    torchrun --nproc_per_node 4 examples/grpo/grpo.py --tp 2 --pp 2 --steps 200      # any layout the trainer has
    WANDB_PROJECT=grpo python examples/grpo/grpo.py ...                              # logged to W&B

The task, verifiable: a prompt is one digit; the reply is --reply tokens; its reward is the share of them equal to the
prompt's digit (copy it). The policy is a random Llama (vocabulary 16), so a reply token is right 1 time in 16 at
first. Each step:
  1. the rollout process (another process, transformers' `generate`, as an inference engine would be) receives the
     policy's weights from `engine.named_weights()`, samples GROUP replies to each prompt, and scores each reply's
     tokens under the frozen initial model (the reference, for the KL term);
  2. group-relative advantages: (reward - the group's mean) / (its std + 1e-4), one per reply;
  3. `engine.logprobs` gives the sampling policy's log-probs (the "old" ones), `engine.forward_backward` the clipped
     surrogate plus β·KL (the k3 estimator against the reference), token-mean over the replies, and `engine.step()`.
Every rank makes the same engine calls with the same batch; rank 0 talks to the rollout process and broadcasts.
Metrics (reward, KL, loss, grad norm) go to <out-dir>/grpo.jsonl and, with WANDB_PROJECT set, to W&B.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from trainer3d.config import TrainConfig  # noqa: E402
from trainer3d.engine import Engine  # noqa: E402

VOCAB, DIGITS = 16, 10  # tokens 0-9: the digits a prompt is drawn from


def hf_config():
    import transformers

    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    tie_word_embeddings=False)


def make_initial_model(path: str, seed: int) -> None:
    import transformers

    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(hf_config()).save_pretrained(path)


def rollout_worker(init_dir: str, inbox, outbox, reply: int, group: int, seed: int) -> None:
    """The inference side: load each new set of weights, sample `group` replies per prompt, and return the rollouts
    with the reference's log-probs of their reply tokens."""
    import transformers

    torch.set_num_threads(1)
    policy = transformers.LlamaForCausalLM.from_pretrained(init_dir).eval()
    reference = transformers.LlamaForCausalLM.from_pretrained(init_dir).eval()
    g = torch.Generator().manual_seed(seed)
    while (msg := inbox.get()) is not None:
        weights, prompts = msg
        policy.load_state_dict(weights)
        with torch.no_grad():
            torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=g)))
            rows = policy.generate(prompts.repeat_interleave(group, 0), do_sample=True, max_new_tokens=reply,
                                   min_new_tokens=reply, top_k=0, top_p=1.0, temperature=1.0, pad_token_id=VOCAB - 1,
                                   eos_token_id=None,
                                   attention_mask=torch.ones(len(prompts) * group, prompts.shape[1], dtype=torch.long))
            logits = reference(rows[:, :-1]).logits.float()
            ref = torch.log_softmax(logits, -1).gather(-1, rows[:, 1:, None])[..., 0]
        outbox.put((rows.clone(), ref.clone()))


def broadcast(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Rank 0's tensor on every rank, through the engine's group (NCCL on GPUs: device tensors)."""
    t = t.to(device)
    dist.broadcast(t, 0)
    return t.cpu()


def group_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    r = rewards.view(-1, group)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)


def grpo_loss(clip: float, kl_coef: float):
    def loss_fn(logprobs, f):
        ratio = torch.exp(logprobs - f["old"])
        surrogate = -torch.min(ratio * f["adv"], ratio.clamp(1 - clip, 1 + clip) * f["adv"])
        log_ref_ratio = f["ref"] - logprobs
        kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1  # k3: unbiased, >= 0
        return surrogate + kl_coef * kl
    return loss_fn


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prompts", type=int, default=8, help="prompts a step")
    ap.add_argument("--group", type=int, default=8, help="replies sampled per prompt")
    ap.add_argument("--reply", type=int, default=4, help="tokens a reply")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--kl-coef", type=float, default=0.01)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default="runs/grpo")
    args = ap.parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    if "RANK" not in os.environ:  # one process: the engine's process group needs a rendezvous all the same
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))
    init_dir = os.path.join(args.out_dir, "init")
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        make_initial_model(init_dir, args.seed)
    else:  # the others wait for rank 0's directory (the engine's group does not exist yet)
        while not os.path.exists(os.path.join(init_dir, "config.json")):
            time.sleep(0.2)
        time.sleep(1.0)
    rows = args.prompts * args.group
    cfg = TrainConfig(init_from_hf=init_dir, seq_len=args.reply, global_batch=rows, micro_batches=args.pp,
                      tp=args.tp, pp=args.pp, precision="fp32", lr=args.lr, warmup_steps=0, min_lr=args.lr,
                      max_steps=args.steps, weight_decay=0.0, grad_clip=1.0, seed=args.seed, out_dir=args.out_dir)
    engine = Engine(cfg, vocab_size=VOCAB)
    worker = log = wandb_run = None
    if rank == 0:
        ctx = mp.get_context("spawn")
        inbox, outbox = ctx.Queue(), ctx.Queue()
        worker = ctx.Process(target=rollout_worker, args=(init_dir, inbox, outbox, args.reply, args.group, args.seed))
        worker.start()
        log = open(os.path.join(args.out_dir, "grpo.jsonl"), "w")
        if os.environ.get("WANDB_PROJECT"):
            import wandb

            wandb_run = wandb.init(project=os.environ["WANDB_PROJECT"], config=vars(args), dir=args.out_dir)
    g = torch.Generator().manual_seed(args.seed + 1)
    loss_fn = grpo_loss(args.clip, args.kl_coef)
    for step in range(1, args.steps + 1):
        weights = {k: v for k, v in engine.named_weights() if rank == 0}  # every rank iterates; rank 0 keeps them
        prompts = torch.randint(0, DIGITS, (args.prompts, 1), generator=g)
        tokens = torch.zeros(rows, 1 + args.reply, dtype=torch.long)  # [digit, reply...]: every target is a reply's
        ref = torch.zeros(rows, args.reply)
        if rank == 0:
            inbox.put((weights, prompts))
            tokens, ref = outbox.get()
        tokens, ref = broadcast(tokens, engine.device), broadcast(ref, engine.device)
        rewards = (tokens[:, 1:] == tokens[:, :1]).float().mean(1)
        adv = group_advantages(rewards, args.group)
        old = engine.logprobs(tokens)
        loss = engine.forward_backward(tokens, loss_fn, aggregation="token-mean",
                                       fields={"old": old, "adv": adv[:, None], "ref": ref})
        record = {"step": step, "reward": rewards.mean().item(), "loss": loss, **engine.step()}
        record["kl"] = float((torch.exp(ref - old) - (ref - old) - 1).mean())
        if rank == 0:
            log.write(json.dumps(record) + "\n")
            log.flush()
            print(f"step {step:4d} | reward {record['reward']:.3f} | kl {record['kl']:.4f} | loss {loss:+.4f} | "
                  f"grad_norm {record['grad_norm']:.3f}", flush=True)
            if wandb_run is not None:
                wandb_run.log(record, step=step)
    if rank == 0:
        inbox.put(None)
        worker.join()
        log.close()
        if wandb_run is not None:
            wandb_run.finish()
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
