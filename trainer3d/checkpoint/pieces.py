"""Where a rank's tensors lie in the full (layout-free) tensors, as boxes of global offsets, and reading any box back
from the pieces that cover it. This is the arithmetic of the sharded checkpoint (format.py): each rank writes the
part of every tensor it owns as pieces named `<kind>/<name>@<offsets>+<sizes>`, and a loader reads only the pieces,
and within them only the byte ranges (safetensors slices), that overlap the box it needs.

Written by hand because torch.distributed.checkpoint's planner, which does the same, keeps its index in a pickled
`.metadata` file (we never unpickle on load) and knows nothing of fused, padded tensor-parallel shards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")  # a parameter's AdamW moments
# a parameter's fp32 value and its moments, pieced alike; a model's tables (state that is no parameter: a router's
# selection bias, trained by loss-free balancing); and the run's tables (state of the objective that every rank holds
# whole, written whole by rank 0 in its own dtype: the DPO reference log-probs)
KINDS = ("param", *MOMENTS, "table", "run")


@dataclass(frozen=True)
class Box:
    """A block of a local tensor (`local` offsets) and where it lies in the full tensor (`start`), `size` long."""

    local: tuple[int, ...]
    start: tuple[int, ...]
    size: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.size:
            n *= s
        return n


def _at(t: tuple[int, ...], dim: int, value: int) -> tuple[int, ...]:
    return t[:dim] + (value,) + t[dim + 1:]


def tp_boxes(spec, local_shape: tuple[int, ...], tp_rank: int, tp: int) -> list[Box]:
    """Where this tp rank's shard of a parameter (TPSpec `spec`, None: replicated) lies in the full, unpadded tensor:
    one box, or one per fused block (q|k|v, gate|up), the vocabulary's padding rows left out."""
    zeros = (0,) * len(local_shape)
    if spec is None:
        return [Box(zeros, zeros, tuple(local_shape))]
    d, real = spec.dim, spec.full_shape[spec.dim]
    blocks = list(spec.fused) if spec.fused else [spec.padded or real]
    boxes, local_at, block_at = [], 0, 0
    for block in blocks:
        per_rank = block // tp
        start = block_at + tp_rank * per_rank
        length = max(0, min(per_rank, real - start))
        if length:
            boxes.append(Box(_at(zeros, d, local_at), _at(zeros, d, start), _at(tuple(local_shape), d, length)))
        local_at += per_rank
        block_at += block
    return boxes


def local_shape(spec, full_shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """The shape of a tp rank's shard of a tensor of `full_shape` (TPSpec `spec`; None: replicated)."""
    if spec is None:
        return tuple(full_shape)
    total = sum(spec.fused) if spec.fused else (spec.padded or spec.full_shape[spec.dim])
    return _at(tuple(spec.full_shape), spec.dim, total // tp)


def slice_boxes(boxes: list[Box], local_shape: tuple[int, ...], index: int, count: int) -> list[Box]:
    """The part of `boxes` in the `index`-th of `count` balanced slices of the local tensor along dim 0: how the
    replicas of a tensor (over dp, and over tp when it is not sharded) split the writing between them."""
    n = local_shape[0]
    return rows_of(boxes, n * index // count, n * (index + 1) // count)


def rows_of(boxes: list[Box], lo: int, hi: int) -> list[Box]:
    """The part of `boxes` in rows [lo, hi) (dim 0) of the local tensor."""
    out = []
    for b in boxes:
        a, e = max(lo, b.local[0]), min(hi, b.local[0] + b.size[0])
        if a < e:
            shift = a - b.local[0]
            out.append(Box(_at(b.local, 0, a), _at(b.start, 0, b.start[0] + shift), _at(b.size, 0, e - a)))
    return out


def flat_range_boxes(shape: tuple[int, ...], lo: int, hi: int):
    """The blocks of a C-contiguous tensor of `shape` that its flat elements [lo, hi) make up, in order, as
    (flat index of the block's first element, origin, size): at most a partial row, whole rows, a partial row, each
    partial row split the same way one dimension down. How a ZeRO partition (a flat range of a parameter) is written
    as pieces without assembling anything (save.py)."""
    if lo >= hi:
        return
    if len(shape) <= 1:
        yield lo, (lo,), (hi - lo,)
        return
    row = math.prod(shape[1:])
    rest = (0,) * (len(shape) - 1)
    if lo % row:  # a partial first row
        r = lo // row
        end = min(hi, (r + 1) * row)
        for f, o, z in flat_range_boxes(shape[1:], lo - r * row, end - r * row):
            yield r * row + f, (r, *o), (1, *z)
        lo = end
    if hi - lo >= row:  # whole rows
        n = (hi - lo) // row
        yield lo, (lo // row, *rest), (n, *shape[1:])
        lo += n * row
    if lo < hi:  # a partial last row
        r = lo // row
        for f, o, z in flat_range_boxes(shape[1:], 0, hi - r * row):
            yield r * row + f, (r, *o), (1, *z)


def partition_boxes(spec, local_shape: tuple[int, ...], tp_rank: int, tp: int, start: int,
                    numel: int) -> list[tuple[int, Box]]:
    """A flat range [start, start + numel) of this tp rank's shard of a parameter (TPSpec `spec`; None: not sharded),
    as boxes of the full tensor: (offset of the box's first element in the range, box), the vocabulary's padding left
    out. Every box is a contiguous stretch of the range, so its data is a view of the partition."""
    strides = [math.prod(local_shape[i + 1:]) for i in range(len(local_shape))]
    out = []
    for flat, origin, size in flat_range_boxes(tuple(local_shape), start, start + numel):
        for b in tp_boxes(spec, tuple(local_shape), tp_rank, tp):
            lo = [max(o, bl) for o, bl in zip(origin, b.local)]
            hi = [min(o + z, bl + bz) for o, z, bl, bz in zip(origin, size, b.local, b.size)]
            if any(h <= lo_ for lo_, h in zip(lo, hi)):
                continue
            first = sum(i * st for i, st in zip(lo, strides))
            box = Box(local=tuple(lo), start=tuple(g + (i - bl) for g, i, bl in zip(b.start, lo, b.local)),
                      size=tuple(h - lo_ for lo_, h in zip(lo, hi)))
            assert flat <= first and first - flat + box.numel <= math.prod(size), "a piece would not be contiguous"
            out.append((first - start, box))
    return out


def piece_key(kind: str, name: str, start: tuple[int, ...], size: tuple[int, ...]) -> str:
    return f"{kind}/{name}@{','.join(map(str, start))}+{','.join(map(str, size))}"


def parse_key(key: str) -> tuple[str, str, tuple[int, ...], tuple[int, ...]]:
    """(kind, name, start, size) of a piece key; ValueError if it is not one."""
    head, _, where = key.rpartition("@")
    kind, _, name = head.partition("/")
    start, _, size = where.partition("+")
    to_ints = lambda s: tuple(int(x) for x in s.split(",")) if s else ()  # noqa: E731
    if kind not in KINDS or not name or len(to_ints(start)) != len(to_ints(size)):
        raise ValueError(f"{key!r} is not a checkpoint piece key")
    return kind, name, to_ints(start), to_ints(size)


@dataclass(frozen=True)
class Piece:
    file: str
    key: str
    start: tuple[int, ...]
    size: tuple[int, ...]


def read_region(pieces: list[Piece], start: tuple[int, ...], size: tuple[int, ...],
                read: Callable[[str, str, tuple[slice, ...]], torch.Tensor], dtype=torch.float32) -> torch.Tensor:
    """The block [start, start+size) of a full tensor, assembled from the pieces that overlap it; `read(file, key,
    slices)` reads one slice of one stored piece (only those bytes). Raises LookupError naming the first element
    no piece covers."""
    out = torch.empty(size, dtype=dtype)
    covered = 0
    for p in pieces:
        lo = [max(a, b) for a, b in zip(start, p.start)]
        hi = [min(a + s, b + t) for a, s, b, t in zip(start, size, p.start, p.size)]
        if any(h <= l for l, h in zip(lo, hi)):
            continue
        src = tuple(slice(l - b, h - b) for l, h, b in zip(lo, hi, p.start))
        dst = tuple(slice(l - a, h - a) for l, h, a in zip(lo, hi, start))
        out[dst] = read(p.file, p.key, src).to(dtype)
        n = 1
        for l, h in zip(lo, hi):
            n *= h - l
        covered += n
    if covered != out.numel():  # pieces never overlap (each is written once), so a shortfall is a hole
        raise LookupError(f"the pieces cover {covered} of the {out.numel()} elements at {start}+{size}")
    return out


def read_local(pieces: list[Piece], boxes: list[Box], local_shape: tuple[int, ...], read, dtype=torch.float32,
               flat: tuple[int, int] | None = None) -> torch.Tensor:
    """A rank's local tensor (zeros where no box reaches: the vocabulary's padding rows) from the boxes it covers;
    with `flat` = (start, numel), only that range of the flattened tensor (a ZeRO-3 partition), reading only the
    rows it spans."""
    row = math.prod(local_shape[1:])
    lo, hi = (0, local_shape[0]) if flat is None else (flat[0] // row, -(-(flat[0] + flat[1]) // row))
    out = torch.zeros((hi - lo,) + tuple(local_shape[1:]), dtype=dtype)
    for b in rows_of(boxes, lo, hi):
        dst = (slice(b.local[0] - lo, b.local[0] - lo + b.size[0]),) + tuple(
            slice(o, o + s) for o, s in zip(b.local[1:], b.size[1:]))
        out[dst] = read_region(pieces, b.start, b.size, read, dtype)
    if flat is None:
        return out
    return out.reshape(-1).narrow(0, flat[0] - lo * row, flat[1])
