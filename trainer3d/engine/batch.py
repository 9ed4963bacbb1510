"""What a call of the engine trains on: each token's weight in the aggregated loss, and rollouts of any count and
length packed into the pipeline's fixed rows.

The pipeline runs static shapes (torch's stages are built for [micro-batch rows, seq_len]), so rollouts of any
shape become passes of `global_batch` rows of seq_len + 1 tokens: sequences packed into rows first-fit decreasing
(several a row where the model masks documents, else one), rows dealt to (pass, dp rank) slots largest first to the
slot with the fewest tokens (longest-processing-time: dp ranks get equal work), as few passes as the rows need.
Aggregations are defined over sequences, whatever row or pass holds them.
"""

from __future__ import annotations

import dataclasses
import heapq
import math

import torch

from trainer3d.errors import ConfigError

AGGREGATIONS = ("token-mean", "sequence-mean", "sum")


def _check_total(total) -> None:
    if total is not None and (isinstance(total, bool) or not isinstance(total, (int, float)) or not total > 0):
        raise ConfigError(f"batch_total must be a positive number (the whole batch's masked tokens under token-mean, "
                          f"its sequences under sequence-mean); got {total!r}.")


def token_weights(mask: torch.Tensor, aggregation: str, sequences: torch.Tensor | None = None,
                  total: float | None = None) -> torch.Tensor:
    """[B, T] float64: each token's weight in the aggregated loss over the whole batch (0 where mask is False).
    `sequences` [B, T]: the sequence (document) of each predicted token within its row, where rows are packed (None:
    a row is one sequence); sequence-mean weighs a masked token 1/(n_seq · n_i), n_seq the sequences with a masked
    token, n_i its sequence's masked tokens (GRPO's 1/G Σ_i 1/|o_i| Σ_t), whatever row the sequence shares.
    `total`: where this call is part of a batch split over several calls, the whole batch's masked tokens
    (token-mean) or sequences (sequence-mean), in the place of this call's."""
    _check_total(total)
    m = mask.double()
    if aggregation == "token-mean":
        return m / (total or m.sum().clamp(min=1))
    if aggregation == "sequence-mean":
        docs = torch.zeros(m.shape, dtype=torch.long) if sequences is None else sequences.long()
        keys = torch.stack([torch.arange(m.shape[0])[:, None].expand_as(docs), docs], -1).reshape(-1, 2)
        _, seq = torch.unique(keys, dim=0, return_inverse=True)  # (row, document) -> one id per sequence
        per_seq = torch.zeros(int(seq.max()) + 1, dtype=torch.float64).index_add_(0, seq, m.reshape(-1))
        n_seq = total or (per_seq > 0).sum().clamp(min=1)
        return m / per_seq[seq].view_as(m).clamp(min=1) / n_seq
    if aggregation == "sum":
        return m
    raise ConfigError(f"aggregation must be one of {', '.join(AGGREGATIONS)} (got {aggregation!r}).")


@dataclasses.dataclass
class Packing:
    """Where each sequence of a call sits: `place[i]` = (pass, row, first token) of sequences[i]; `lengths[i]` its
    tokens. Passes are [rows, width] (global_batch, seq_len + 1)."""

    passes: int
    rows: int
    width: int
    place: list[tuple[int, int, int]]
    lengths: list[int]

    def tokens(self, sequences: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """([P, rows, width] token ids, [P, rows, width] each token's document, [P, rows, width - 1] which inputs
        are real): padding is token 0 in a document of its own, after the row's sequences."""
        shape = (self.passes, self.rows, self.width)
        tokens, documents = torch.zeros(shape, dtype=torch.long), torch.zeros(shape, dtype=torch.long)
        filled = torch.zeros(self.passes, self.rows, dtype=torch.long)
        placed = torch.zeros(self.passes, self.rows, dtype=torch.long)  # sequences placed in each row so far
        for i in sorted(range(len(sequences)), key=self.place.__getitem__):  # each row's sequences in order
            (p, r, start), s = self.place[i], sequences[i]
            tokens[p, r, start:start + len(s)] = s
            documents[p, r, start:start + len(s)] = placed[p, r]
            placed[p, r] += 1
            filled[p, r] = start + len(s)
        positions = torch.arange(self.width)
        documents = torch.where(positions >= filled[..., None], self.width, documents)  # padding: one document
        return tokens, documents, positions[:-1] < filled[..., None]

    def per_token(self, values: list, fill: float = 0.0) -> torch.Tensor:
        """[P, rows, width - 1] float64: sequence i's values (a tensor of its len - 1 predicted tokens, or one
        number) where its tokens predict its next ones; `fill` elsewhere."""
        out = torch.full((self.passes, self.rows, self.width - 1), fill, dtype=torch.float64)
        for v, (p, r, start), n in zip(values, self.place, self.lengths):
            out[p, r, start:start + n - 1] = torch.as_tensor(v, dtype=torch.float64)
        return out

    def unpack(self, out: torch.Tensor) -> list[torch.Tensor]:
        """[P, rows, width - 1, ...] -> sequence i's [len - 1, ...] values."""
        return [out[p, r, start:start + n - 1] for (p, r, start), n in zip(self.place, self.lengths)]


def pack(lengths: list[int], rows: int, width: int, dp: int, several_a_row: bool) -> Packing:
    """Place sequences of `lengths` tokens (each <= width) into passes of `rows` rows of `width` tokens, `rows / dp`
    rows of each pass on each dp rank; several sequences a row where `several_a_row` (the model masks documents)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []  # each row's sequences; first-fit decreasing
    free: list[int] = []
    for i in order:
        fit = next((b for b, room in enumerate(free) if room >= lengths[i]), None) if several_a_row else None
        if fit is None:
            bins.append([])
            free.append(width)
            fit = len(bins) - 1
        bins[fit].append(i)
        free[fit] -= lengths[i]
    per = rows // dp
    passes = max(1, math.ceil(len(bins) / rows))
    slots = [(0, p, d) for p in range(passes) for d in range(dp)]  # (tokens, pass, dp rank): a heap by tokens
    taken = {(p, d): 0 for _, p, d in slots}
    heapq.heapify(slots)
    place: list[tuple[int, int, int]] = [(0, 0, 0)] * len(lengths)
    for b in sorted(range(len(bins)), key=lambda b: free[b]):  # the fullest rows first
        tokens, p, d = heapq.heappop(slots)
        row = d * per + taken[(p, d)]
        taken[(p, d)] += 1
        start = 0
        for i in bins[b]:
            place[i] = (p, row, start)
            start += lengths[i]
        if taken[(p, d)] < per:
            heapq.heappush(slots, (tokens + width - free[b], p, d))
    return Packing(passes, rows, width, place, list(lengths))


def _is_number(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) or (torch.is_tensor(v) and v.dim() == 0)


def check_rollouts(sequences: list, seq_len: int, vocab: int) -> None:
    """Rollouts: a non-empty list of 1-D integer token tensors of 2 to seq_len + 1 tokens, ids in the vocabulary."""
    if not sequences:
        raise ConfigError("rollouts must be a non-empty list of 1-D token tensors; got an empty list.")
    for i, s in enumerate(sequences):
        if not torch.is_tensor(s) or s.dim() != 1 or s.dtype.is_floating_point or s.dtype.is_complex \
                or s.dtype == torch.bool:
            got = f"{s.dtype} of shape {list(s.shape)}" if torch.is_tensor(s) else f"a {type(s).__name__}"
            raise ConfigError(f"rollout {i} must be a 1-D tensor of integer token ids; got {got}.")
        if not 2 <= len(s) <= seq_len + 1:
            raise ConfigError(f"rollout {i} has {len(s)} tokens; a rollout holds 2 to seq_len + 1 = {seq_len + 1} "
                              f"(raise seq_len, or cut it).")
        check_ids(s, vocab, f"rollout {i}'s tokens")


def check_ids(tokens: torch.Tensor, vocab: int, name: str) -> None:
    """Token ids in [0, vocab), in one pass over them (torch.aminmax)."""
    low, high = (int(x) for x in torch.aminmax(tokens))
    if low < 0 or high >= vocab:
        raise ConfigError(f"{name} must be ids in [0, {vocab}) (the model's vocabulary); got ids from {low} to "
                          f"{high}.")


def check_rollout_values(sequences: list, mask, fields: dict) -> list[torch.Tensor]:
    """The rollouts' masks (a list of [len - 1], or None: every predicted token) and fields (lists of [len - 1]
    tensors or numbers), aligned with them; returns the masks as bool tensors."""
    n = len(sequences)
    for name, values in [("mask", mask)] + [(f"fields[{k!r}]", v) for k, v in fields.items()]:
        if values is None and name == "mask":
            continue
        if not isinstance(values, (list, tuple)) or len(values) != n:
            got = f"{len(values)} values" if isinstance(values, (list, tuple)) else f"a {type(values).__name__}"
            raise ConfigError(f"{name} must be a list of {n} values, one per rollout; got {got}.")
        for i, (s, v) in enumerate(zip(sequences, values)):
            if name != "mask" and _is_number(v):
                continue
            if not torch.is_tensor(v) or tuple(v.shape) != (len(s) - 1,):
                got = list(v.shape) if torch.is_tensor(v) else f"a {type(v).__name__}"
                one = "" if name == "mask" else ", or one number"
                raise ConfigError(f"{name}[{i}] must be a tensor [{len(s) - 1}] (one value per predicted token of "
                                  f"rollout {i}{one}); got {got}.")
    return [torch.ones(len(s) - 1, dtype=torch.bool) for s in sequences] if mask is None else [m.bool() for m in mask]
