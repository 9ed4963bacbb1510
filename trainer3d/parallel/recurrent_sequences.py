"""A recurrent mixer's view of a rank's sequences (models/attention.WholeSequences is the one-rank view): where its
documents start (--document-mask: the state and the convolution restart there), and, under context parallelism, an
all-to-all that trades this rank's tokens of every head for the whole sequence of 1/cp of the heads.

Why an all-to-all and not passing the state from rank to rank (Megatron's way): the heads of a linear attention are
independent, so after the exchange each rank runs the ordinary chunked recurrence over the whole sequence and no rank
waits for another's state; the load-balanced chunk order of context parallelism (two chunks per rank) costs nothing,
where a state pass would run the 2·cp chunks one after another. Each rank sends and receives (cp−1)/cp of its
projections' output (q|k|v and the write and decay gates) and of the recurrence's output, the volume of Ulysses'
attention exchange. Gradients: a rank's share of the per-head tables (its heads' convolution channels, decays and
biases) holds every cp rank's tokens, the others' shares are zero, so averaging over dp×cp gives the full gradient as
for any parameter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainer3d.distributed.collectives import group_size


def _to_heads(x: torch.Tensor, group, gathered: torch.Tensor) -> torch.Tensor:
    """[B, T_local, cp·c] (c channels per destination) -> [B, T, c], the sequence in its natural order."""
    cp = group_size(group)
    B, Tl, W = x.shape
    send = x.reshape(B, Tl, cp, W // cp).permute(2, 1, 0, 3).contiguous()  # [cp, T_local, B, c]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[r]: rank r's tokens of this rank's heads
    rows = recv.reshape(cp * Tl, B, W // cp)  # in gathered order: rank 0's positions, then rank 1's, ...
    natural = torch.empty_like(rows)
    natural[gathered] = rows
    return natural.permute(1, 0, 2)


def _to_sequence(y: torch.Tensor, group, gathered: torch.Tensor) -> torch.Tensor:
    """The inverse: [B, T, c] of this rank's heads -> [B, T_local, cp·c], every rank's heads of this rank's tokens."""
    cp = group_size(group)
    B, T, c = y.shape
    send = y.permute(1, 0, 2)[gathered].reshape(cp, T // cp, B, c).contiguous()  # send[r]: rank r's positions
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[r]: this rank's tokens of rank r's heads
    return recv.permute(2, 1, 0, 3).reshape(B, T // cp, cp * c)


class _Exchange(torch.autograd.Function):
    """One exchange forward (`there`) and its transpose backward (`back`): _to_heads and _to_sequence are each
    other's."""

    @staticmethod
    def forward(ctx, x, group, gathered, there, back):
        ctx.group, ctx.gathered, ctx.back = group, gathered, back
        return there(x, group, gathered)

    @staticmethod
    def backward(ctx, grad):
        return ctx.back(grad.contiguous(), ctx.group, ctx.gathered), None, None, None, None


class RecurrentSequences:
    """The view parallel/context_parallel.SequenceLayout gives every recurrent mixer of its stages (their
    `sequence`): its cp group and rank, and the running micro-batch's documents in natural order."""

    def __init__(self, layout):
        self.layout = layout
        self.size, self.rank = layout.size, layout.rank

    # (each outside torch.compile's graphs: Python state, the running micro-batch, and collectives)
    @torch.compiler.disable
    def documents(self) -> torch.Tensor | None:
        if not self.layout.document_mask:
            return None
        return self.layout.documents[self.layout.micro_batch]  # [mb, seq_len]: whole rows, as to_heads gives

    @torch.compiler.disable
    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.size == 1 else _Exchange.apply(x, self.layout.group, self.layout.gathered_positions,
                                                        _to_heads, _to_sequence)

    @torch.compiler.disable
    def to_sequence(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.size == 1 else _Exchange.apply(y, self.layout.group, self.layout.gathered_positions,
                                                        _to_sequence, _to_heads)
