"""Reads W&B's offline `.wandb` files back (wandb ships no reader): a sequence of CRC-checked records, each a
`wandb.proto.wandb_internal_pb2.Record`, enough to compare logged history and config with metrics.jsonl."""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any, Iterator


_BLOCK = 32768
_CHUNK_HEADER = 7


def _records(data: bytes) -> Iterator[bytes]:
    if data[:4] != b":W&B" or struct.unpack("<H", data[4:6])[0] != 0xBEE1:
        raise ValueError("not a .wandb file (bad header)")
    pos, pending = 7, b""
    while pos + _CHUNK_HEADER <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _CHUNK_HEADER:  # block trailer: zero padding
            pos += left_in_block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + _CHUNK_HEADER])
        if crc == 0 and length == 0 and kind == 0:  # zero padding up to the end of the block
            pos += left_in_block
            continue
        chunk = data[pos + _CHUNK_HEADER : pos + _CHUNK_HEADER + length]
        if len(chunk) < length:
            break  # a truncated tail (file still being written)
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != crc:
            raise ValueError(f"CRC mismatch at byte {pos}")
        pos += _CHUNK_HEADER + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk
            pending = b""
        else:
            raise ValueError(f"unknown chunk type {kind} at byte {pos}")


def read_wandb_file(path: str):
    """Every record of a .wandb file, as wandb_internal_pb2.Record messages, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    with open(path, "rb") as f:
        data = f.read()
    out = []
    for raw in _records(data):
        rec = pb.Record()
        rec.ParseFromString(raw)
        out.append(rec)
    return out


def _item_value(item) -> Any:
    which = item.WhichOneof("value")
    if which is None:
        return json.loads(item.value_json) if item.value_json else None
    if which == "none":
        return None
    if which == "json":
        return json.loads(item.json)
    return getattr(item, which)


def read_history(path: str) -> list[dict]:
    """The logged history rows of a .wandb file: one dict per wandb.log call (wandb's own `_step`, `_runtime`,
    `_timestamp` keys included)."""
    rows = []
    for rec in read_wandb_file(path):
        if rec.WhichOneof("record_type") == "history":
            rows.append({"/".join(i.nested_key) if i.nested_key else i.key: _item_value(i) for i in rec.history.item})
    return rows


def read_config(path: str) -> dict:
    """The run's config (the last value of each key) from a .wandb file."""
    config = {}
    for rec in read_wandb_file(path):
        kind = rec.WhichOneof("record_type")
        items = rec.run.config.update if kind == "run" else rec.config.update if kind == "config" else []
        for item in items:
            config[item.key] = json.loads(item.value_json)
    return config
