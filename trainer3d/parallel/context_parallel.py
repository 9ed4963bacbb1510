"""Context parallelism (--cp) and document masking (--document-mask): where a rank's tokens sit in the sequence and
what each of them may attend to.

Context parallelism splits every sequence over the cp ranks of a dp replica. The sequence is cut into 2·cp equal
chunks and rank r holds chunks r and 2·cp−1−r (the causal mask's load balance: every rank gets the same share of the
attention work). Everything outside attention is per token, so a stage runs on its 2·T/(2·cp) tokens as on a shorter
sequence; positions (learned or rotary) are the chunks' global ones (`position_ids`). Attention all-gathers keys and
values over the cp group (the Llama 3 paper's scheme: with grouped-query attention only the kv heads travel; the
backward reduce-scatters their gradients) and each local chunk attends to the keys up to its own end.
Why not torch's `context_parallel`: it is ring attention over DTensor, SDPA's CUDA kernels only, and needs the
buffers it shards at entry (no pipeline stages, no packed-document mask).

Document masking: a packed row holds several documents, each opened by the end-of-text token that precedes it (the
prepared shards' convention, llm.c's), or, for chat rows, known from the data (data/batch.py); with --document-mask a token attends only to earlier tokens of its own
document, and with --reset-position-ids its position restarts at each document's first token (Megatron-LM's flag).
The documents of a row are known from its tokens, which every rank of the replica has (Trainer.begin_pass), so no
stage needs them sent; the stage class tells the layout which micro-batch runs (`micro_batch`), for the forward and
for the recomputation in the backward alike. Kernels: flex_attention (CUDA, compiled once; it skips fully masked
blocks) or SDPA with a boolean mask (CPU, where flex_attention has no backward; dropout anywhere).

Gradients: each cp rank's loss is the mean over its tokens, all ranks hold as many, and the data-parallel engines
average over dp×cp, so the gradient is that of the mean over the whole sequence (Megatron-LM's reduction group).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from trainer3d.data.batch import document_ids
from trainer3d.distributed.collectives import all_gather_into, group_size, reduce_scatter_into
from trainer3d.errors import LayoutError
from trainer3d.parallel.recurrent_sequences import RecurrentSequences
from trainer3d.models.attention import WholeKeys, WholeSequences, gqa
from trainer3d.private_api import require

KV_SEQ_DIM = 2  # q, k, v are [batch, heads, sequence, head_dim]


def chunk_starts(seq_len: int, rank: int, size: int) -> list[int]:
    """The global start of each chunk rank `rank` holds, in local order (one chunk, the whole row, at cp 1)."""
    if size == 1:
        return [0]
    c = seq_len // (2 * size)
    return [rank * c, (2 * size - 1 - rank) * c]


def local_positions(seq_len: int, rank: int, size: int) -> torch.Tensor:
    """The global positions of a rank's tokens, in its local order."""
    c = seq_len // (2 * size) if size > 1 else seq_len
    return torch.cat([torch.arange(s, s + c) for s in chunk_starts(seq_len, rank, size)])


def positions_in_document(documents: torch.Tensor) -> torch.Tensor:
    """[B, T] document ids -> each token's position counted from its document's first token."""
    T = documents.shape[1]
    index = torch.arange(T, device=documents.device).expand_as(documents)
    opens = torch.ones_like(documents, dtype=torch.bool)
    opens[:, 1:] = documents[:, 1:] != documents[:, :-1]
    start = torch.cummax(torch.where(opens, index, torch.zeros_like(index)), dim=1).values
    return index - start


class _GatherSequence(torch.autograd.Function):
    """All-gather a rank's tokens over the cp group into the sequence's natural order (forward); reduce-scatter the
    gradients of every rank's view back to the owner (backward: every rank's queries used every key)."""

    @staticmethod
    def forward(ctx, x, group, gathered_positions):
        ctx.group, ctx.gathered_positions = group, gathered_positions
        rows = x.movedim(KV_SEQ_DIM, 0).contiguous()
        out = rows.new_empty((group_size(group) * rows.shape[0],) + tuple(rows.shape[1:]))
        all_gather_into(out, rows, group)
        natural = torch.empty_like(out)
        natural[gathered_positions] = out  # row j of the gather is position gathered_positions[j]
        return natural.movedim(0, KV_SEQ_DIM)

    @staticmethod
    def backward(ctx, grad):
        rows = grad.movedim(KV_SEQ_DIM, 0)[ctx.gathered_positions].contiguous()
        out = rows.new_empty((rows.shape[0] // group_size(ctx.group),) + tuple(rows.shape[1:]))
        reduce_scatter_into(out, rows, ctx.group)
        return out.movedim(0, KV_SEQ_DIM), None, None


class _AfterEarlierKeys(torch.autograd.Function):
    """Causal attention of a chunk of queries that starts `start` tokens into the keys: every earlier key is visible
    (one unmasked flash call) and the chunk's own keys causally (one causal flash call); the two are merged by their
    log-sum-exps, and the backward runs flash's backward on each part with the merged output and log-sum-exp (the
    ring-attention identity). On CPU this replaces SDPA's lower-right causal mask, which SDPA materializes and keeps
    for the backward as a float tensor of queries × keys per layer. Grouped kv heads are repeated inside, not saved
    repeated. CPU flash kernels only (aten's, private: checked by trainer3d/private_api.py); no dropout."""

    @staticmethod
    def forward(ctx, q, k, v, start):
        group = q.shape[1] // k.shape[1]
        ka, va, kb, vb = (_repeat_heads(t, group) for t in (k[:, :, :start], v[:, :, :start], k[:, :, start:],
                                                              v[:, :, start:]))
        out_a, lse_a = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, ka, va)
        out_b, lse_b = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, kb, vb, is_causal=True)
        lse = torch.logaddexp(lse_a, lse_b)
        out = (torch.exp(lse_a - lse)[..., None] * out_a + torch.exp(lse_b - lse)[..., None] * out_b).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.start, ctx.group = start, group
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        start, group = ctx.start, ctx.group
        grads = []
        for sl, causal in ((slice(None, start), False), (slice(start, None), True)):
            kp, vp = _repeat_heads(k[:, :, sl], group), _repeat_heads(v[:, :, sl], group)
            grads.append(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad.contiguous(), q, kp, vp, out, lse, 0.0, causal))
        dq = grads[0][0] + grads[1][0]
        dk = torch.cat([_sum_heads(grads[0][1], group), _sum_heads(grads[1][1], group)], dim=KV_SEQ_DIM)
        dv = torch.cat([_sum_heads(grads[0][2], group), _sum_heads(grads[1][2], group)], dim=KV_SEQ_DIM)
        return dq, dk, dv, None


def _repeat_heads(t: torch.Tensor, group: int) -> torch.Tensor:
    t = t.contiguous()
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def _sum_heads(t: torch.Tensor, group: int) -> torch.Tensor:
    B, H, S, D = t.shape
    return t if group == 1 else t.view(B, H // group, group, S, D).sum(dim=2)


def causal_after(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, dropout_p: float) -> torch.Tensor:
    """Causal attention of queries q at positions [start, start + len(q)) over keys k, v at positions
    [0, start + len(q)): CUDA's SDPA kernels take the lower-right causal mask without materializing it; on CPU,
    _AfterEarlierKeys (dropout needs SDPA's masked kernel)."""
    if start == 0:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, **gqa(q, k))
    if q.device.type == "cpu" and dropout_p == 0.0:
        return _AfterEarlierKeys.apply(q, k, v, start)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]),
                                          dropout_p=dropout_p, **gqa(q, k))


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


class SequenceLayout:
    """One rank's view of its sequences, shared by all its stages: which global positions it holds (cp), which
    document each token of the running micro-batch belongs to (documents), and the attention that follows. Installed
    on every attention module (`kernel`) and every module that reads positions (`position_ids`) by `apply`."""

    def __init__(self, seq_len: int, cp_group, cp_rank: int, cp: int, device: torch.device,
                 boundary: int | None = None, document_mask: bool = False, reset_position_ids: bool = False):
        if cp > 1 and device.type == "cpu":
            require("parallel/context_parallel.py")  # _AfterEarlierKeys's CPU flash kernels
        self.seq_len, self.group, self.rank, self.size = seq_len, cp_group, cp_rank, cp
        self.starts = chunk_starts(seq_len, cp_rank, cp)
        self.chunk = seq_len // (2 * cp) if cp > 1 else seq_len
        self.positions = local_positions(seq_len, cp_rank, cp).to(device)
        self.gathered_positions = torch.cat([local_positions(seq_len, r, cp) for r in range(cp)]).to(device)
        self.boundary, self.document_mask, self.reset_position_ids = boundary, document_mask, reset_position_ids
        self.use_flex = device.type == "cuda"
        self.documents: list[torch.Tensor] = []  # per micro-batch of the running pass: [mb, seq_len] document ids
        self.document_positions: list[torch.Tensor] = []  # per micro-batch: [mb, T_local] (--reset-position-ids)
        self.micro_batch = 0  # set by the pipeline stage around each forward and backward (parallel/pipeline.py)
        self._masks: dict = {}  # (micro-batch, chunk) -> its document mask, built once and shared by every layer

    @property
    def needs_documents(self) -> bool:
        return self.document_mask or self.reset_position_ids

    # ---- the data side: called by the trainer ------------------------------------------------------------------
    def begin_pass(self, inputs: torch.Tensor, micro_batches: int, documents: torch.Tensor | None = None) -> None:
        """Before a schedule pass over `inputs` [local_batch, seq_len] (whole rows): the documents of each of its
        micro-batches, split as the schedule splits its arguments; `documents` [local_batch, seq_len] where the data
        knows them (chat rows: an end-of-text token inside a conversation opens none), else from the boundary token."""
        self._masks.clear()
        if self.needs_documents:
            docs = (documents.to(self.positions.device) if documents is not None
                    else document_ids(inputs.to(self.positions.device), self.boundary))
            self.documents = list(docs.tensor_split(micro_batches))
        if self.reset_position_ids:
            self.document_positions = [positions_in_document(d)[:, self.positions] for d in self.documents]

    def split(self, x: torch.Tensor, blocks: int = 1) -> torch.Tensor:
        """This rank's tokens of rows x [B, blocks·seq_len + extra] (token ids or targets; `blocks` rows of targets
        side by side: multi-token prediction's depths); columns past them (tags that travel with a row) are kept
        whole."""
        if self.size == 1:
            return x
        n = blocks * self.seq_len
        local = x[:, :n].unflatten(1, (blocks, self.seq_len))[:, :, self.positions.to(x.device)].flatten(1)
        return torch.cat([local, x[:, n:]], dim=1)

    # ---- the model side: installed on the stage's modules ------------------------------------------------------
    def position_ids(self, start: int, T: int, device: torch.device) -> torch.Tensor:
        """[T] global positions of the local tokens, or [mb, T] positions within their documents."""
        if start != 0 or T != len(self.positions):
            raise RuntimeError(f"a {T}-token pass at position {start} on a rank laid out for {len(self.positions)} "
                               "tokens; incremental decoding runs without context parallelism")
        if self.reset_position_ids:
            return self.document_positions[self.micro_batch].to(device)
        return self.positions.to(device)

    def gather_keys(self, t: torch.Tensor) -> torch.Tensor:
        """t [B, h, T_local, d] -> [B, h, seq_len, d] in the sequence's order (the cp all-gather; one process, or t
        gathered already: t)."""
        if self.size == 1 or t.shape[KV_SEQ_DIM] == self.seq_len:
            return t
        return _GatherSequence.apply(t, self.group, self.gathered_positions)

    def visible(self, T: int, device: torch.device) -> torch.Tensor:
        """[B|1, T_local, seq_len] bool: the keys each local query may see (causal; its own document under
        --document-mask), for attention that masks by itself (models/attention.WholeKeys)."""
        if T != len(self.positions):
            raise RuntimeError(f"{T} queries on a rank laid out for {len(self.positions)} tokens")
        key = ("visible", self.micro_batch)  # built once a micro-batch, shared by every layer (cleared by begin_pass)
        if key not in self._masks:
            q_pos = self.positions.to(device)  # their places in the row (not --reset-position-ids' rotary positions)
            mask = (torch.arange(self.seq_len, device=device) <= q_pos[:, None]).unsqueeze(0)
            if self.document_mask:
                docs = self.documents[self.micro_batch].to(device)
                mask = mask & (docs[:, None, :] == docs[:, q_pos, None])
            self._masks[key] = mask
        return self._masks[key]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
        """q [B, Hq, T_local, hd] (this rank's chunks), k, v [B, Hkv, T_local, hd] -> [B, Hq, T_local, hd]; k and v
        may come gathered already, [B, Hkv, seq_len, hd] (MLA gathers its latent, not its keys and values)."""
        if self.size > 1 and k.shape[KV_SEQ_DIM] != self.seq_len:
            kv = _GatherSequence.apply(torch.cat([k, v], dim=1), self.group, self.gathered_positions)
            k, v = kv.split(k.shape[1], dim=1)
        outs = []
        for i, start in enumerate(self.starts):
            qc = q[:, :, i * self.chunk:(i + 1) * self.chunk]
            end = start + self.chunk
            kc, vc = k[:, :, :end], v[:, :, :end]  # keys past the chunk's end are all masked
            if self.document_mask:
                outs.append(self._documents_attention(qc, kc, vc, i, start, dropout_p))
            else:
                outs.append(causal_after(qc, kc, vc, start, dropout_p))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=KV_SEQ_DIM)

    def _documents_attention(self, q, k, v, chunk: int, start: int, dropout_p: float) -> torch.Tensor:
        flex = self.use_flex and dropout_p == 0.0
        key = (self.micro_batch, chunk, flex)
        if key not in self._masks:
            docs = self.documents[self.micro_batch].to(q.device)
            q_pos = torch.arange(start, start + self.chunk, device=q.device)
            k_docs, q_docs = docs[:, : k.shape[2]], docs[:, start:start + self.chunk]
            self._masks[key] = self._flex_block_mask(q_docs, k_docs, q_pos) if flex else (
                (k_docs[:, None, None, :] == q_docs[:, None, :, None])
                & (torch.arange(k.shape[2], device=q.device) <= q_pos[:, None]))
        if flex:
            return _compiled_flex_attention()(q, k, v, block_mask=self._masks[key], **gqa(q, k))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self._masks[key], dropout_p=dropout_p, **gqa(q, k))

    @staticmethod
    def _flex_block_mask(q_docs, k_docs, q_pos):
        from torch.nn.attention.flex_attention import create_block_mask

        def same_document_causal(b, h, qi, kj):
            return (kj <= q_pos[qi]) & (k_docs[b, kj] == q_docs[b, qi])

        B, Q, K = q_docs.shape[0], q_docs.shape[1], k_docs.shape[1]
        return create_block_mask(same_document_causal, B, None, Q, K, device=q_docs.device)


class LayoutKeys(WholeKeys):
    """The layout's view of the keys (models/attention.WholeKeys), outside torch.compile's graphs."""

    def __init__(self, layout: SequenceLayout):
        self.size = layout.size
        self.gather = torch.compiler.disable(layout.gather_keys)
        self.visible = torch.compiler.disable(layout.visible)


def apply_context_parallel(stage, layout: SequenceLayout):
    """Point every attention module of `stage` at the layout's attention, every module that reads positions at its
    positions, and every recurrent mixer at its documents and head exchange (parallel/recurrent_sequences.py), in
    place. Both stay outside torch.compile's graphs (Python state: the running micro-batch)."""
    attend = torch.compiler.disable(layout.attend)
    position_ids = torch.compiler.disable(layout.position_ids)
    recurrent = RecurrentSequences(layout)
    keys = LayoutKeys(layout)
    for m in stage.modules():
        if hasattr(m, "kernel"):
            m.kernel = attend
        if isinstance(getattr(m, "keys", None), WholeKeys):  # attention that masks by itself (DSA's)
            m.keys = keys
        if hasattr(m, "position_ids"):
            m.position_ids = position_ids
        if isinstance(getattr(m, "sequence", None), WholeSequences):  # a recurrent mixer (a linear attention)
            m.sequence = recurrent
    return stage


def check_context_parallel(cp: int, seq_len: int) -> None:
    """Refuse, before any process group exists, a sequence the cp ranks cannot split (how sequence parallelism splits
    a rank's tokens further: sequence_parallel.check_sequence_parallel)."""
    if cp > 1 and seq_len % (2 * cp):
        raise LayoutError(f"--cp {cp} cuts each sequence into 2·cp = {2 * cp} equal chunks (two per rank, for the "
                          f"causal mask's balance); pick a --seq-len divisible by {2 * cp} (got {seq_len}).")
