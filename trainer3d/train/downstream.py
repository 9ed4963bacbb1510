"""Forward-only passes with a reduction of their own in the loss's place, at any layout: HellaSwag accuracy and text
samples, during training (loop.py) and from a checkpoint (trainer3d.evaluate).

One mechanism serves both (`forward_rows`). Rows go through the model in ordinary global batches (the last one padded),
each dp rank taking its rows as validation does (data.val_batches), through the Trainer's pipeline schedule with
`Trainer.forward_only`: on the last stage, each micro-batch's logits shard goes to the reduction instead of the loss.
The global row index travels with its row (an extra target column), so the schedule's micro-batch order never
matters. The last stage's ranks put their results at their rows' indices in a zero tensor and one all-reduce over
the layout gives every rank every row: each entry has one writer per context shard (one without --cp), and a
reduction is a sum over its row's tokens, so the shards' partial sums add up to the row's and every rank holds the
same values. Every rank runs every pass (pipeline, tp, cp and ZeRO-3 exchanges).

Sampling recomputes the whole window for each new token (as llm.c does during training; python -m trainer3d.sample
has the KV cache): the reduction keeps the logits of the last position, every rank picks the same next token from
the same all-reduced logits with the same generator (seeded from the seed and the step), so every stage has it
without a broadcast and a seed gives the same text at every layout.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from trainer3d.data import load_tokenizer, val_batches
from trainer3d.data.hellaswag import IGNORE, Example, HellaSwagResult, ScoringRows, encode_rows, score
from trainer3d.distributed.collectives import all_reduce
from trainer3d.generate import pick_next_token

# make_batch(global row indices) -> (inputs [n, seq_len], targets [n, seq_len], documents [n, seq_len] where the rows
# know them, else None: from the boundary token under --document-mask); indices past the rows are padding
MakeBatch = Callable[[np.ndarray], "tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]"]
# reduction(logits shard [mb, T, vocab/tp], targets [mb, T]) -> [mb, width], a sum over the T tokens (T: seq_len,
# or this rank's seq_len/cp tokens under context parallelism: the targets are split alike)
Reduction = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def forward_rows(trainer, n_rows: int, make_batch: MakeBatch, reduction: Reduction, width: int,
                 vocab_sharded: bool = False) -> torch.Tensor:
    """[n_rows, width] (float32, on every rank of the layout): `reduction` of every row. With `vocab_sharded` the
    reduction returns this tp rank's vocab columns ([mb, width]) and the result holds them all ([n_rows, tp·width]);
    otherwise its result is the same on every tp rank (it reduced over tp) and tp rank 0's is kept."""
    topo, gb = trainer.topo, trainer.plan.global_batch
    passes = max(1, -(-n_rows // gb))
    writes = trainer.parallel_model.has_last and (vocab_sharded or topo.tp_rank == 0)
    col0 = topo.tp_rank * width if vocab_sharded else 0
    out = torch.zeros(n_rows, width * topo.layout.tp if vocab_sharded else width, device=trainer.device)

    def tagged(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.cat([targets[:, -1:].float(), reduction(logits, targets[:, :-1]).float()], dim=1)

    index = np.arange(passes * gb, dtype=np.int64)[:, None]  # sharded over dp like validation rows
    for batch in val_batches(index, gb, topo.dp_rank, topo.layout.dp):
        rows = batch.tokens
        inputs, targets, documents = make_batch(rows[:, 0].numpy())
        results = trainer.forward_only(inputs, torch.cat([targets, rows], dim=1), tagged, documents)
        if writes:
            got = torch.cat(results)
            ids = got[:, 0].long()
            keep = ids < n_rows
            out[ids[keep], col0 : col0 + width] = got[keep, 1:]
    return all_reduce(out, topo.world_group)


# ---- HellaSwag --------------------------------------------------------------------------------------------------
def hellaswag(trainer, rows: ScoringRows, pad_id: int) -> HellaSwagResult:
    """Every row's summed loss over its ending's tokens and their count, then the picks (data/hellaswag.py)."""

    def masked_row_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        scored = targets != IGNORE
        per_token = trainer.token_losses(logits, targets.clamp(min=0)) * scored
        return torch.stack([per_token.sum(dim=1), scored.sum(dim=1).float()], dim=1)

    out = forward_rows(trainer, len(rows), lambda idx: (*rows.batch(idx, pad_id), None), masked_row_losses, width=2)
    out = out.cpu().numpy()
    return score(rows, out[:, 0], out[:, 1])


# ---- samples ----------------------------------------------------------------------------------------------------
def sample(trainer, prompt: list[int], count: int, n_tokens: int, temperature: float, top_k: int | None,
           generator: torch.Generator, pad_id: int) -> list[list[int]]:
    """`count` continuations of `prompt` (token ids), `n_tokens` each, one forward pass per token over the last
    seq_len tokens of each sequence; identical on every rank."""
    seq_len, vocab = trainer.cfg.seq_len, trainer.mcfg.vocab_size
    seqs = torch.tensor(prompt, dtype=torch.long).repeat(count, 1)
    for _ in range(n_tokens):
        window = seqs[:, -seq_len:]
        last = window.shape[1] - 1

        def make_batch(idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, None]:
            inputs = torch.full((len(idx), seq_len), pad_id, dtype=torch.long)
            mine = idx < count
            inputs[torch.from_numpy(mine), : window.shape[1]] = window[torch.from_numpy(idx[mine])]
            at_last = torch.zeros(len(idx), seq_len, dtype=torch.long)
            at_last[:, last] = 1  # marks the position whose logits are kept (on whichever cp rank holds it)
            return inputs, at_last, None

        logits = forward_rows(trainer, count, make_batch, lambda lg, at_last: (lg * at_last[..., None]).sum(dim=1),
                              width=trainer.parallel_model.padded_vocab // trainer.topo.layout.tp, vocab_sharded=True)
        next_ids = pick_next_token(logits[:, :vocab].cpu(), temperature, top_k, generator)
        seqs = torch.cat([seqs, next_ids[:, None]], dim=1)
    return seqs[:, len(prompt):].tolist()


def sample_generator(seed: int, step: int) -> torch.Generator:
    """The draws of the samples at `step`: a function of the seed and the step only (the same at every layout)."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) % 2**63)


def tokenizer_encoder(tok) -> Callable[[list[str]], list[list[int]]]:
    return lambda texts: tok(texts, add_special_tokens=False)["input_ids"]


class Downstream:
    """What the training loop runs beside its own validation: HellaSwag at every evaluation (`--eval-hellaswag`) and
    samples every `--sample-every` steps. With neither flag it is a no-op and loads nothing."""

    def __init__(self, trainer, examples: list[Example] | tuple[Example, ...] | None = None):
        cfg = trainer.cfg
        self.trainer, self.cfg = trainer, cfg
        self.rows, self.tok = None, None
        if examples or cfg.sample_every:
            self.tok = load_tokenizer(cfg.tokenizer, cfg.trust_remote_code)
            self.pad_id = self.tok.eos_token_id
        if examples:
            self.rows = encode_rows(examples, tokenizer_encoder(self.tok), cfg.seq_len, trainer.mcfg.vocab_size)
        if cfg.sample_every:  # a document starts after end-of-text: so does every sample
            self.prompt = [self.tok.eos_token_id] + tokenizer_encoder(self.tok)([cfg.sample_prompt])[0]

    def evaluate(self) -> dict:
        """{'hellaswag_acc', 'hellaswag_acc_sum'}, or {} without --eval-hellaswag."""
        return {} if self.rows is None else hellaswag(self.trainer, self.rows, self.pad_id).metrics()

    def samples_due(self, step: int, last: bool) -> bool:
        return bool(self.cfg.sample_every) and (step % self.cfg.sample_every == 0 or last)

    def samples(self) -> list[str]:
        """The prompt and its continuation, decoded, for each sample."""
        cfg = self.cfg
        tokens = sample(self.trainer, self.prompt, cfg.sample_count, cfg.sample_tokens, cfg.sample_temperature,
                        cfg.sample_top_k or None, sample_generator(cfg.seed, self.trainer.step), self.pad_id)
        return [self.tok.decode(self.prompt[1:] + t) for t in tokens]
