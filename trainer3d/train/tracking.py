"""Weights & Biases tracking: one run, on the trainer's logging rank only.

On when a project is given (`--wandb-project` or `WANDB_PROJECT`) or `--wandb-mode online|offline` is passed;
off otherwise. The mode comes from `--wandb-mode`, else `WANDB_MODE`, else online. The other standard `WANDB_*`
variables (WANDB_ENTITY, WANDB_DIR, WANDB_API_KEY, ...) are read by wandb itself; run files go to
`<out-dir>/wandb/` unless WANDB_DIR says otherwise. Nothing from the environment is put into the logged config, so
the API key is never logged (wandb itself never prints it).

The config logged is the TrainConfig as a dict, the layout (with --layout auto's choice), the batch plan, the model's sizes and, with
`--deepspeed_config`, the DeepSpeed JSON. Each step logs the same record that metrics.jsonl gets (None values
dropped, a mapping such as a mixture's `data_mix` spread into `data_mix/<source>`); text samples (`--sample-every`) go to a table, `samples`. A resumed run (trainer.step > 0 at start)
continues the W&B run whose id is in `<out-dir>/wandb_run_id`.

tests/helpers/wandb_reader.py decodes the `.wandb` files back, to compare the logged history with metrics.jsonl.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import Any

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
    config: dict[str, Any] = {
        "train": cfg.flat(),
        "layout": {
            "dp": topo.layout.dp,
            "tp": topo.layout.tp,
            "pp": topo.layout.pp,
            "cp": topo.layout.cp,
            "world_size": topo.layout.world_size,
            "schedule": cfg.schedule,
            "stages": trainer.parallel_model.n_stages,
            "layers_per_stage": [len(r) for r in trainer.parallel_model.layer_ranges],
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
            "flops_per_token": mcfg.flops_per_token(cfg.seq_len),
        },
        "device": str(trainer.device),
        "precision": trainer.precision,
    }
    if cfg.layout_choice is not None:  # --layout auto: the pick, the runner-up and why
        config["layout"]["auto"] = cfg.layout_choice
    if isinstance(cfg.deepspeed_config, dict):
        config["deepspeed"] = cfg.deepspeed_config
    elif cfg.deepspeed_config:
        try:
            with open(cfg.deepspeed_config) as f:
                config["deepspeed"] = json.load(f)
        except (OSError, ValueError) as e:  # the DeepSpeed layer reports a bad file; tracking just notes it
            config["deepspeed"] = {"error": f"could not read {cfg.deepspeed_config}: {e}"}
    if trainer.deepspeed is not None:  # what deepspeed.initialize got: "auto" values filled in from the layout
        config["deepspeed_resolved"] = trainer.deepspeed.ds_config
    return config


def flat(record: dict) -> dict:
    """A record as W&B logs it: None values and the step dropped, a mapping (a mixture's `data_mix`) spread into one
    series per key, `data_mix/<source>`."""
    out = {}
    for k, v in record.items():
        if isinstance(v, dict):
            out.update({f"{k}/{sub}": x for sub, x in v.items() if x is not None})
        elif v is not None and k != "step":
            out[k] = v
    return out


class Tracker:
    """A W&B run on the logging rank; a no-op everywhere else and when tracking is off."""

    def __init__(self, trainer):
        cfg = trainer.cfg
        self.run = None
        self.sample_rows: list[list] = []  # every sample so far: each logged table holds the whole history
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
            self.run.log(flat(record), step=record["step"])

    def log_samples(self, step: int, texts: list[str]) -> None:
        """Text samples as a W&B table (step, sample, text); each log carries all samples so far, so the newest
        version of the table shows how the text changed over training."""
        if self.run is not None:
            import wandb

            self.sample_rows += [[step, i, text] for i, text in enumerate(texts)]
            self.run.log({"samples": wandb.Table(columns=["step", "sample", "text"], data=self.sample_rows)}, step=step)

    def finish(self, exit_code: int = 0) -> None:
        if self.run is not None:
            self.run.finish(exit_code=exit_code)
            self.run = None


# ---- reading a .wandb file back -------------------------------------------------------------------------------
# The file is a 7-byte header (":W&B", magic 0xBEE1, version 0) followed by LevelDB-log-style blocks of 32 KiB:
# each chunk is crc32 (IEEE, seeded with the chunk type byte) u32, length u16, type u8 (1 full, 2 first,
# 3 middle, 4 last), then the data. A record is a serialized wandb_internal_pb2.Record.
