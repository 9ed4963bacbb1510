"""The piece arithmetic of the sharded checkpoint (trainer3d/checkpoint/pieces.py) against brute force: where each
tp rank's shard of a tensor lies in the full tensor (plain, fused q|k|v and padded-vocabulary splits along either
dim), that the ranks' slices store every element exactly once, and that any block or flat range reads back from the
pieces that cover it. One process, no files: a piece is read from an in-memory dict."""

from __future__ import annotations

import itertools

import pytest
import torch

from trainer3d.checkpoint.pieces import (
    Piece, local_shape, parse_key, partition_boxes, piece_key, read_local, read_region, slice_boxes, tp_boxes,
)
from trainer3d.checkpoint.writer import write_safetensors
from trainer3d.parallel.tensor_parallel import TPSpec, shard_tensor

SPECS = {  # name: (full shape, spec or None)
    "replicated": ((6, 5), None),
    "column": ((8, 6), TPSpec(0, (8, 6))),
    "row": ((6, 8), TPSpec(1, (6, 8))),
    "fused q|k|v (GQA)": ((16, 4), TPSpec(0, (16, 4), fused=(8, 4, 4))),
    "padded vocab": ((10, 3), TPSpec(0, (10, 3), padded=16)),
    "bias": ((12,), TPSpec(0, (12,), fused=(4, 4, 4))),
}


def _full(shape):
    return torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float32).reshape(shape)


def _pieces_of(full: torch.Tensor, spec, tp: int, dp: int):
    """What the ranks of a (dp, tp) layout write, as save.rank_pieces does: {key: tensor}."""
    stored = {}
    for tp_rank, dp_rank in itertools.product(range(tp), range(dp)):
        local = shard_tensor(full, spec, tp_rank, tp) if spec else full
        index, count = (dp_rank, dp) if spec else (dp_rank * tp + tp_rank, dp * tp)
        for b in slice_boxes(tp_boxes(spec, tuple(local.shape), tp_rank, tp), tuple(local.shape), index, count):
            stored[piece_key("param", "w", b.start, b.size)] = local[tuple(slice(o, o + s) for o, s in
                                                                        zip(b.local, b.size))].clone()
    return stored


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("tp,dp", [(1, 1), (2, 1), (2, 3), (4, 2)])
def test_every_element_once_and_every_shard_back(name, tp, dp):
    shape, spec = SPECS[name]
    full = _full(shape)
    stored = _pieces_of(full, spec, tp, dp)
    count = torch.zeros(shape)
    pieces = []
    for key, t in stored.items():
        kind, tensor, start, size = parse_key(key)
        assert (kind, tensor) == ("param", "w") and tuple(t.shape) == size
        block = tuple(slice(a, a + n) for a, n in zip(start, size))
        assert torch.equal(full[block], t), f"{key} holds the wrong block"
        count[block] += 1
        pieces.append(Piece("mem", key, start, size))
    assert torch.equal(count, torch.ones(shape)), "an element stored twice or never"

    read = lambda file, key, slices: stored[key][slices]  # noqa: E731
    for tp_rank in range(tp):  # any tp layout reads its shard back (padding rows zero), whole or by flat range
        local = shard_tensor(full, spec, tp_rank, tp) if spec else full
        assert local_shape(spec, shape, tp) == tuple(local.shape)
        boxes = tp_boxes(spec, tuple(local.shape), tp_rank, tp)
        assert torch.equal(read_local(pieces, boxes, tuple(local.shape), read), local)
        n = local.numel()
        for start, numel in [(0, n), (1, n - 2), (n // 3, n // 3), (n - 1, 1), (n // 2, 0)]:
            got = read_local(pieces, boxes, tuple(local.shape), read, flat=(start, numel))
            assert torch.equal(got, local.reshape(-1)[start:start + numel])


def test_a_hole_is_named():
    full = _full((4, 4))
    stored = {piece_key("param", "w", (0, 0), (2, 4)): full[:2].clone()}
    pieces = [Piece("mem", k, *parse_key(k)[2:]) for k in stored]
    with pytest.raises(LookupError, match="cover 8 of the 16 elements"):
        read_region(pieces, (0, 0), (4, 4), lambda f, k, s: stored[k][s])
    with pytest.raises(ValueError, match="not a checkpoint piece key"):
        parse_key("rng.cpu")


@pytest.mark.parametrize("full_shape,spec,tp", [
    ((10, 6), None, 1), ((3, 4, 5), None, 1), ((13,), None, 1),
    ((12, 5), TPSpec(0, (12, 5), fused=(4, 4, 4)), 2),  # q|k|v blocks, each split over tp
    ((7, 8), TPSpec(1, (7, 8)), 2),  # a row-parallel weight
    ((10, 4), TPSpec(0, (10, 4), padded=12), 2),  # a vocabulary padded to 12 rows
])
def test_a_flat_partition_is_written_as_boxes_of_the_full_tensor(full_shape, spec, tp):
    """ZeRO's partitions (equal flat ranges of each tp shard, the last one short) as pieces: each box's data is a
    contiguous view of its partition, equal to that box of the full tensor, and every element is written once."""
    full = torch.randn(full_shape)
    covered = torch.zeros(full_shape)
    for tp_rank in range(tp):
        flat = (full if spec is None else shard_tensor(full, spec, tp_rank, tp)).reshape(-1)
        local_shape = tuple(full.shape) if spec is None else tuple(shard_tensor(full, spec, tp_rank, tp).shape)
        per = -(-flat.numel() // 3)  # three dp ranks
        for k in range(3):
            lo, hi = min(flat.numel(), k * per), min(flat.numel(), (k + 1) * per)
            for offset, box in partition_boxes(spec, local_shape, tp_rank, tp, lo, hi - lo):
                region = tuple(slice(s, s + n) for s, n in zip(box.start, box.size))
                assert torch.equal(flat[lo:hi].narrow(0, offset, box.numel).view(box.size), full[region])
                covered[region] += 1
    assert torch.equal(covered, torch.ones(full_shape))


def test_written_files_are_safetensors_with_the_digest_of_their_bytes(tmp_path):
    import hashlib

    from safetensors import safe_open

    tensors = {"param/w@0,0+2,2": torch.randn(5, 4)[1:3, :2], "rng.cpu": torch.get_rng_state(), "none": torch.zeros(0)}
    info = write_safetensors(tensors, tmp_path / "f.safetensors", {"format": "pt"})
    assert info["sha256"] == hashlib.sha256((tmp_path / "f.safetensors").read_bytes()).hexdigest()
    assert info["bytes"] == (tmp_path / "f.safetensors").stat().st_size and info["tensors"] == sorted(tensors)
    with safe_open(str(tmp_path / "f.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert all(torch.equal(f.get_tensor(k), v) for k, v in tensors.items())
