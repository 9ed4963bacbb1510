"""A checkpoint file written once and hashed on the way: the safetensors format (an 8-byte little-endian header
length, a JSON header of dtypes, shapes and byte offsets, then the tensors' bytes), streamed from the tensors' own
memory. Written by hand because safetensors' `save_file` gives no digest, so hashing meant reading every file back
(a second pass over all the bytes of a save); the files it writes load with safetensors' own readers (tested)."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import torch

from trainer3d.fsio import fsync_path

# torch dtype -> safetensors' name (what checkpoints hold: fp32 state, uint8 RNG states, int64/float32 scalars)
DTYPES = {torch.float32: "F32", torch.uint8: "U8", torch.int64: "I64", torch.float64: "F64", torch.bfloat16: "BF16",
          torch.float16: "F16", torch.int32: "I32"}


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> dict:
    """Write `tensors` (CPU, any layout: each is written from its contiguous form) to `path`, fsync it, and return
    {"bytes", "sha256", "tensors"}: the file's size and digest, computed while writing."""
    names = sorted(tensors)
    header, offset = {"__metadata__": dict(metadata)}, 0
    for name in names:
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format pads the header to 8 bytes
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in (struct.pack("<Q", len(encoded)), encoded):
            f.write(chunk)
            digest.update(chunk)
        for name in names:
            t = tensors[name].detach().contiguous()
            if t.numel():
                data = memoryview(t.view(torch.uint8).reshape(-1).numpy())  # the tensor's own bytes, no copy
                f.write(data)
                digest.update(data)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(path.parent)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest(), "tensors": names}
