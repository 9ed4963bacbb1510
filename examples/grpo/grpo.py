"""GRPO on trainer3d.engine: a complete loop on an SFT export, small enough for a CPU, at any layout.

    python examples/grpo/sft.py --out-dir runs/grpo_sft                               # the SFT export (task.py)
    python examples/grpo/grpo.py --model runs/grpo_sft/hf --steps 60 --out-dir runs/grpo
    torchrun --nproc_per_node 4 examples/grpo/grpo.py --model runs/grpo_sft/hf --tp 2 --pp 2 ...   # any layout
    WANDB_PROJECT=grpo python examples/grpo/grpo.py ...                                # logged to W&B

The task (task.py): "7 x 3 =" asks for " 7 7 7" and the end of the turn; the reward is 1 for the exact reply, less
for a wrong count or digit, 0 for a reply that never ends. The SFT model ends its replies at eos, with counts right
about half the time. Each step:
  1. the rollout process (another process, transformers' `generate` as an inference engine would be) receives the
     policy's weights from `engine.named_weights()`, samples --group replies to each of --prompts prompts through the
     model's chat template, each ending at eos or at --max-reply tokens, and scores the replies' tokens under the
     frozen SFT model (the reference, for the KL term);
  2. rewards, and group-relative advantages (r - the group's mean) / (its std + 1e-4), one per reply;
  3. `engine.logprobs` gives the sampling policy's log-probs (the "old" ones) of the rollouts, a list of sequences of
     their own lengths; then --minibatches updates, each `engine.forward_backward` of the clipped surrogate plus
     β·KL (k3) over one mini-batch of groups, token-mean over the replies' tokens (eos included), and `engine.step()`.
     From the second update on the policy has moved, so the ratio leaves 1 and the clip acts (logged: how often).
Every rank makes the same engine calls with the same rollouts; rank 0 talks to the rollout process and broadcasts.
Metrics go to <out-dir>/grpo.jsonl and, with WANDB_PROJECT set, to W&B.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(os.path.dirname(HERE))]

from task import MAX_COUNT, prompt, reward  # noqa: E402

from trainer3d.config import TrainConfig  # noqa: E402
from trainer3d.engine import Engine  # noqa: E402


def grpo_loss(clip: float, kl_coef: float):
    """Per token: -min(ρA, clip(ρ, 1 - ε, 1 + ε)A) + β·k3(ref ‖ policy), ρ = exp(logp - logp_old)."""
    def loss_fn(logprobs, f):
        ratio = torch.exp(logprobs - f["old"])
        surrogate = -torch.min(ratio * f["adv"], ratio.clamp(1 - clip, 1 + clip) * f["adv"])
        log_ref_ratio = f["ref"] - logprobs
        kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1  # k3: unbiased, >= 0
        return surrogate + kl_coef * kl
    return loss_fn


def clipped_share(new: list, old: list, masks: list, adv: list, clip: float) -> float:
    """The share of the replies' tokens whose ratio the clip holds (ρ > 1 + ε with A > 0, ρ < 1 - ε with A < 0)."""
    held = total = 0
    for n, o, m, a in zip(new, old, masks, adv):
        ratio = torch.exp(n - o)[m]
        held += int(((ratio > 1 + clip) & (a > 0)).sum() + ((ratio < 1 - clip) & (a < 0)).sum())
        total += int(m.sum())
    return held / max(total, 1)


def rollout_worker(model_dir: str, inbox, outbox, group: int, max_reply: int, temperature: float, seed: int):
    """The inference side: load each new set of weights, sample `group` replies per prompt (each to its eos or
    `max_reply` tokens), and return each rollout (prompt + reply tokens), where its reply starts, whether it ended,
    and the reference's log-probs of its tokens."""
    import transformers

    torch.set_num_threads(1)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    policy = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    torch.manual_seed(seed)
    while (msg := inbox.get()) is not None:
        weights, prompts = msg
        policy.load_state_dict(weights)
        out = []
        for text in prompts:
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)["input_ids"]
            with torch.no_grad():
                rows = policy.generate(ids.repeat(group, 1), attention_mask=torch.ones_like(ids).repeat(group, 1),
                                       do_sample=True, max_new_tokens=max_reply, top_k=0,
                                       top_p=1.0, temperature=temperature, eos_token_id=tok.eos_token_id,
                                       pad_token_id=tok.eos_token_id)
            for row in rows:
                reply = row[ids.shape[1]:].tolist()
                ended = tok.eos_token_id in reply
                reply = reply[:reply.index(tok.eos_token_id) + 1] if ended else reply
                seq = torch.tensor(ids[0].tolist() + reply)
                with torch.no_grad():
                    logp = torch.log_softmax(reference(seq[None, :-1]).logits[0].float() / temperature, -1)
                text_out = tok.decode(reply[:-1] if ended else reply)
                out.append((seq, ids.shape[1], ended, text_out, logp.gather(-1, seq[1:, None])[:, 0]))
        outbox.put(out)


def share(obj, device: torch.device):
    """Rank 0's scored rollouts, (sequence, reply start, ended, reward, reference log-probs) each, on every rank: the
    sequences and log-probs as flat tensors with their lengths, the rest as numbers (through the engine's group:
    NCCL on GPUs). Every rank must then make the same engine calls with the same values."""
    if dist.get_world_size() == 1:
        return obj
    n = torch.tensor([len(obj) if obj else 0], device=device)
    dist.broadcast(n, 0)
    lengths = torch.tensor([len(s) for s, *_ in obj] if obj else [0] * int(n), device=device)
    meta = torch.tensor([[start, ended, r] for _, start, ended, r, _ in obj] if obj else [[0.0] * 3] * int(n),
                        dtype=torch.float64, device=device)
    dist.broadcast(lengths, 0), dist.broadcast(meta, 0)
    sizes = lengths.tolist()
    flat = torch.cat([s for s, *_ in obj]).to(device) if obj else torch.zeros(sum(sizes), dtype=torch.long,
                                                                                device=device)
    ref = torch.cat([r for *_, r in obj]).to(device) if obj else torch.zeros(sum(sizes) - len(sizes), device=device)
    dist.broadcast(flat, 0), dist.broadcast(ref, 0)
    seqs, refs = flat.cpu().split(sizes), ref.cpu().split([s - 1 for s in sizes])
    return [(s, int(m[0]), bool(m[1]), float(m[2]), r) for s, m, r in zip(seqs, meta.tolist(), refs)]


def group_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    r = rewards.view(-1, group)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the SFT export to start from (examples/grpo/sft.py)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--prompts", type=int, default=8, help="prompts a step")
    ap.add_argument("--group", type=int, default=8, help="replies sampled per prompt")
    ap.add_argument("--minibatches", type=int, default=4, help="updates a step, each on prompts/minibatches groups")
    ap.add_argument("--max-reply", type=int, default=2 * MAX_COUNT)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--kl-coef", type=float, default=0.01)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default="runs/grpo")
    args = ap.parse_args(argv)
    if args.prompts % args.minibatches:
        ap.error(f"--prompts ({args.prompts}) must be a multiple of --minibatches ({args.minibatches})")
    return args


def update(engine, rollouts, adv, args, loss_fn) -> dict:
    """The old log-probs, then --minibatches clipped updates over groups of rollouts."""
    seqs = [s for s, *_ in rollouts]
    masks = [torch.arange(len(s) - 1) >= start - 1 for s, start, *_ in rollouts]  # predicting the reply's tokens
    old = engine.logprobs(seqs, temperature=args.temperature)
    per = len(seqs) // args.minibatches
    clipped, stats = [], {}
    for m in range(args.minibatches):
        part = slice(m * per, (m + 1) * per)
        fields = {"old": old[part], "adv": adv[part].tolist(), "ref": [r for *_, r in rollouts[part]]}
        if m:  # the policy has moved since `old`: how often the clip holds the ratio
            now = engine.logprobs(seqs[part], temperature=args.temperature)
            clipped.append(clipped_share(now, old[part], masks[part], adv[part], args.clip))
        stats["loss"] = engine.forward_backward(seqs[part], loss_fn, mask=masks[part], fields=fields,
                                                aggregation="token-mean", temperature=args.temperature)
        stats.update(engine.step())
    ref = torch.cat([r[m] for (*_, r), m in zip(rollouts, masks)])
    mine = torch.cat([o[m] for o, m in zip(old, masks)])
    stats["kl"] = float((torch.exp(ref - mine) - (ref - mine) - 1).mean())
    stats["clipped"] = sum(clipped) / max(len(clipped), 1)
    return stats


def start_rank0(args):
    """Rank 0's side: the rollout process and its queues, the metrics file, W&B where WANDB_PROJECT is set."""
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    worker = ctx.Process(target=rollout_worker, args=(args.model, inbox, outbox, args.group, args.max_reply,
                                                      args.temperature, args.seed))
    worker.start()
    os.makedirs(args.out_dir, exist_ok=True)
    log = open(os.path.join(args.out_dir, "grpo.jsonl"), "w")
    wandb_run = None
    if os.environ.get("WANDB_PROJECT"):
        import wandb

        wandb_run = wandb.init(project=os.environ["WANDB_PROJECT"], config=vars(args), dir=args.out_dir)
    return worker, inbox, outbox, log, wandb_run


def main(argv=None) -> int:
    args = parse(argv)
    rank = int(os.environ.get("RANK", 0))
    if "RANK" not in os.environ:  # one process: the engine's process group needs a rendezvous all the same
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))
    rows = args.prompts * args.group // args.minibatches  # one mini-batch of rollouts: as many rows at most
    cfg = TrainConfig(init_from_hf=args.model, seq_len=32, global_batch=rows, micro_batches=max(2, args.pp),
                      tp=args.tp, pp=args.pp, precision="fp32", lr=args.lr, warmup_steps=0, min_lr=args.lr,
                      max_steps=args.steps * args.minibatches, weight_decay=0.0, grad_clip=1.0, seed=args.seed,
                      document_mask=True, reset_position_ids=True, out_dir=args.out_dir)
    engine = Engine(cfg)
    worker = inbox = outbox = log = wandb_run = None
    if rank == 0:
        worker, inbox, outbox, log, wandb_run = start_rank0(args)
    rng = random.Random(args.seed + 1)
    loss_fn = grpo_loss(args.clip, args.kl_coef)
    for step in range(1, args.steps + 1):
        start = time.time()
        weights = {k: v for k, v in engine.named_weights() if rank == 0}  # every rank iterates; rank 0 keeps them
        tasks = [(rng.randint(0, 9), rng.randint(1, MAX_COUNT)) for _ in range(args.prompts)]
        if rank == 0:
            inbox.put((weights, [prompt(d, c) for d, c in tasks]))
        scored = None
        if rank == 0:  # the rollouts' texts are here: the rewards too, then every rank gets both
            scored = [(seq, first, ended, reward(text, ended, *tasks[i // args.group]), ref)
                      for i, (seq, first, ended, text, ref) in enumerate(outbox.get())]
        rollouts = share(scored, engine.device)
        rewards = torch.tensor([r for _, _, _, r, _ in rollouts])
        adv = group_advantages(rewards, args.group)
        stats = update(engine, rollouts, adv, args, loss_fn)
        lengths = [len(s) - start for s, start, *_ in rollouts]
        record = {"step": step, "reward": rewards.mean().item(), "exact": (rewards == 1).float().mean().item(),
                  "ended": sum(e for _, _, e, *_ in rollouts) / len(rollouts),
                  "reply_tokens": sum(lengths) / len(lengths), "reply_tokens_max": max(lengths),
                  "seconds": time.time() - start, **stats}
        if rank == 0:
            log.write(json.dumps(record) + "\n")
            log.flush()
            print(f"step {step:4d} | reward {record['reward']:.3f} | exact {record['exact']:.2f} | "
                  f"clipped {record['clipped']:.3f} | kl {record['kl']:.4f} | grad_norm {record['grad_norm']:.3f}",
                  flush=True)
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
