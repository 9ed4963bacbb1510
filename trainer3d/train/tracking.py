"""Weights & Biases tracking: one run, on the trainer's logging rank only.

On when a project is given (`--wandb-project` or `WANDB_PROJECT`) or `--wandb-mode online|offline` is passed;
off otherwise. The mode comes from `--wandb-mode`, else `WANDB_MODE`, else online. The other standard `WANDB_*`
variables (WANDB_ENTITY, WANDB_DIR, WANDB_API_KEY, ...) are read by wandb itself; run files go to
`<out-dir>/wandb/` unless WANDB_DIR says otherwise. Nothing from the environment is put into the logged config, so
the API key is never logged (wandb itself never prints it).

The config logged is the TrainConfig as a dict, the layout, the batch plan, the model's sizes and, with
`--deepspeed_config`, the DeepSpeed JSON. Each step logs the same record that metrics.jsonl gets (None values
dropped). A resumed run (trainer.step > 0 at start) continues the W&B run whose id is in `<out-dir>/wandb_run_id`.

`read_wandb_file` decodes a `.wandb` file back into its records (wandb ships no reader): tests use it to compare
the logged history with metrics.jsonl, and it is handy for inspecting an offline run without syncing it.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import asdict
from typing import Any, Iterator

MODES = ("online", "offline", "disabled")


def resolve_mode(project: str | None, mode: str | None, environ=os.environ) -> str:
    """'online', 'offline' or 'disabled' from the flags and the standard WANDB_* variables."""
    if mode is not None:
        return mode
    if not (project or environ.get("WANDB_PROJECT")):
        return "disabled"
    env_mode = environ.get("WANDB_MODE", "online")
    return "offline" if env_mode in ("offline", "dryrun") else "disabled" if env_mode == "disabled" else "online"


def run_config(trainer) -> dict:
    """Everything about the run worth comparing across runs (and nothing from the environment)."""
    cfg, topo, plan, mcfg = trainer.cfg, trainer.topo, trainer.plan, trainer.mcfg
    from trainer3d.train.metrics import flops_per_token

    config: dict[str, Any] = {
        "train": asdict(cfg),
        "layout": {
            "dp": topo.layout.dp,
            "tp": topo.layout.tp,
            "pp": topo.layout.pp,
            "world_size": topo.layout.world_size,
            "schedule": cfg.schedule,
            "stages": trainer.pm.n_stages,
            "layers_per_stage": [len(r) for r in trainer.pm.layer_ranges],
        },
        "batch": {
            "global_batch": plan.global_batch,
            "micro_batches": plan.micro_batches,
            "micro_batch_size": plan.micro_batch_size,
            "tokens_per_step": plan.global_batch * cfg.seq_len,
        },
        "model": {
            **asdict(mcfg),
            "n_params": mcfg.num_params(),
            "n_params_non_embedding": mcfg.num_params(include_embedding=False),
            "flops_per_token": flops_per_token(mcfg, cfg.seq_len),
        },
        "device": str(trainer.device),
        "precision": trainer.precision,
    }
    if isinstance(cfg.deepspeed_config, dict):
        config["deepspeed"] = cfg.deepspeed_config
    elif cfg.deepspeed_config:
        try:
            with open(cfg.deepspeed_config) as f:
                config["deepspeed"] = json.load(f)
        except (OSError, ValueError) as e:  # the DeepSpeed layer reports a bad file; tracking just notes it
            config["deepspeed"] = {"error": f"could not read {cfg.deepspeed_config}: {e}"}
    spec = getattr(getattr(trainer, "zero", None), "spec", None)
    if spec is not None:  # what deepspeed.initialize got: "auto" values filled in from the layout
        config["deepspeed_resolved"] = spec.ds_config
    return config


class Tracker:
    """A W&B run on the logging rank; a no-op everywhere else and when tracking is off."""

    def __init__(self, trainer):
        cfg = trainer.cfg
        self.run = None
        self.mode = resolve_mode(cfg.wandb_project, cfg.wandb_mode)
        if not trainer.is_logging_rank or self.mode == "disabled":
            return
        import wandb

        os.makedirs(cfg.out_dir, exist_ok=True)
        id_file = os.path.join(cfg.out_dir, "wandb_run_id")
        resume = {}
        if trainer.step > 0 and os.path.exists(id_file):  # a resumed training continues its W&B run
            with open(id_file) as f:
                resume = {"id": f.read().strip(), "resume": "allow"}
        self.run = wandb.init(
            project=cfg.wandb_project,  # None: WANDB_PROJECT, else wandb's default
            name=cfg.wandb_run_name,
            mode=self.mode,
            dir=None if os.environ.get("WANDB_DIR") else cfg.out_dir,
            config=run_config(trainer),
            **resume,
        )
        with open(id_file, "w") as f:
            f.write(self.run.id)

    def log(self, record: dict) -> None:
        if self.run is not None:
            self.run.log({k: v for k, v in record.items() if v is not None and k != "step"}, step=record["step"])

    def finish(self, exit_code: int = 0) -> None:
        if self.run is not None:
            self.run.finish(exit_code=exit_code)
            self.run = None


# ---- reading a .wandb file back -------------------------------------------------------------------------------
# The file is a 7-byte header (":W&B", magic 0xBEE1, version 0) followed by LevelDB-log-style blocks of 32 KiB:
# each chunk is crc32 (IEEE, seeded with the chunk type byte) u32, length u16, type u8 (1 full, 2 first,
# 3 middle, 4 last), then the data. A record is a serialized wandb_internal_pb2.Record.
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
