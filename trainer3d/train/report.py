"""What a run tells its user, on one rank (the logging rank's console: a banner, a progress bar with the ETA, a line
every --log-every steps, samples, a summary; metrics.jsonl; W&B), and what every rank contributes to it (the peak
memory of the interval: a collective on logged steps)."""

from __future__ import annotations

import json
import sys

import torch.distributed as dist

from trainer3d.parallel.fp8 import describe as fp8_description
from trainer3d.train.metrics import MetricsFile, PeakMemory, RunSummary
from trainer3d.train.stragglers import StragglerWatch
from trainer3d.train.tracking import Tracker


class Report:
    """Every record of a run goes through `record`: metrics.jsonl, W&B, the progress bar and the console."""

    def __init__(self, trainer):
        self.cfg, self.trainer = trainer.cfg, trainer
        self.log = trainer.is_logging_rank
        self.metrics = MetricsFile(self.cfg.out_dir, enabled=self.log, append=trainer.step > 0)  # resumed: continue
        self.tracker = Tracker(trainer)  # W&B, on the logging rank only
        self.memory = PeakMemory(trainer.device, trainer.topo.world_group)
        self.summary = RunSummary(trainer.step)
        layout = trainer.topo.layout
        self.stragglers = StragglerWatch(self.cfg.straggler_factor, self.cfg.straggler_intervals,
                                         lambda r: layout.coords(r).label())
        self.bar = None

    def start(self, tokens_per_step: int) -> None:
        """The banner, then the progress bar (in a log file, SLURM's or nohup's, a bar redrawn every step is a wall of
        \r-joined updates: it redraws every 30 s there)."""
        from tqdm import tqdm

        self._banner(tokens_per_step)
        self.bar = tqdm(total=self.cfg.max_steps, initial=self.trainer.step, disable=not self.log, dynamic_ncols=True,
                        unit="step", mininterval=0.1 if sys.stderr.isatty() else 30.0)

    def _banner(self, tokens_per_step: int) -> None:
        """The layout, the model and this rank's memory, where the rank speaks (the logging rank, or --verbose)."""
        t, cfg, plan = self.trainer, self.cfg, self.trainer.plan
        if not (self.log or cfg.verbose):
            return
        print(
            f"[trainer3d] {t.topo.layout} schedule={cfg.schedule} stages={t.parallel_model.n_stages} "
            f"layers/stage={[len(r) for r in t.parallel_model.layer_ranges]} micro-batches={plan.micro_batches}×"
            f"{plan.micro_batch_size} global-batch={plan.global_batch} seqs ({tokens_per_step} tokens) "
            f"model={cfg.init_from_hf or cfg.model} ({t.mcfg.family}, {t.mcfg.num_params() / 1e6:.1f}M params) "
            f"precision={t.precision} device={t.device}", flush=True)
        if cfg.fp8 is not None:
            line = fp8_description(cfg.fp8, t.parallel_model.fp8_layers, t.mcfg.n_layer, cfg.compile)
            print(f"[trainer3d] rank {dist.get_rank()} {line}", flush=True)
        mem = t.engine.memory()
        mib = lambda k: f"{mem[k + '_bytes'] / 2**20:.1f} MiB ({mem[k + '_offloaded_bytes'] / 2**20:.1f} offloaded)"  # noqa: E731
        # DDP's gradients and AdamW's moments (unless resumed) exist from the first step on; DeepSpeed allocates its
        # partitions at start. Either way metrics.jsonl records every step's sizes (grad_bytes, optim_bytes)
        later = [f"{label} {mib(k)}" if mem[k + "_bytes"] else f"{label} from the first step on"
                 for k, label in (("grad", "grads"), ("optim", "optimizer states"))]
        parts = [f"params {mib('param')}", *later]
        print(f"[trainer3d] rank {dist.get_rank()} memory at start ({t.engine.name}): {', '.join(parts)}", flush=True)

    def logged(self, step: int) -> bool:
        """Steps with a console line and the interval's peak memory: alike on every rank (a collective)."""
        return step % self.cfg.log_every == 0 or step == self.cfg.max_steps or step == 1

    def record(self, record: dict) -> None:
        """A step's (or step 0's evaluation) record. Collective on logged steps (every rank must call it)."""
        step = record["step"]
        trained = "loss" in record
        if trained:
            self.stragglers.add(record.pop("rank_step_times", None) or [])
        if trained and self.logged(step):  # the highest of any rank since the previous logged step
            record["peak_mem_bytes"] = self.memory.report()
            record.update(self.stragglers.report())  # the interval's per-rank step times (host values: no read)
        self.metrics.write(record)
        self.summary.observe(record)
        self.tracker.log(record)
        if not trained:
            if self.log:
                self.bar.write(f"step {step:>6} | val_loss {record['val_loss']:.4f}{hellaswag_text(record)}")
            return
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:,.0f}", refresh=False)
        if self.log and self.logged(step):
            fd = self.bar.format_dict  # the ETA in the step lines too, for log files: this run's mean step time
            last = step == self.cfg.max_steps
            eta = None if last or fd["n"] <= fd["initial"] else \
                fd["elapsed"] / (fd["n"] - fd["initial"]) * (self.cfg.max_steps - step)
            self.bar.write(step_line(record, eta))
            for line in self.stragglers.lines():
                self.bar.write(f"[trainer3d] {line}")

    def samples(self, step: int, texts: list[str]) -> None:
        self.tracker.log_samples(step, texts)
        for i, text in enumerate(texts if self.log else []):
            self.bar.write(f"step {step:>6} | sample {i}: {json.dumps(text, ensure_ascii=False)}")

    def close(self, exit_code: int) -> None:
        if self.bar is not None:
            self.bar.close()  # first: an error's sentence then starts on a line of its own
        self.metrics.close()
        self.tracker.finish(exit_code)

    def summarize(self, last_checkpoint) -> None:
        chat = self.cfg.data_format != "text"
        for line in self.summary.lines(self.cfg.out_dir, last_checkpoint, chat) if self.log else []:
            print(line, flush=True)


def step_line(record: dict, eta_s: float | None) -> str:
    """A step's console line, from its metrics record."""
    from tqdm import tqdm

    mtp = f" | mtp_loss {record['mtp_loss']:.4f}" if "mtp_loss" in record else ""  # (multi-token prediction)
    line = (f"step {record['step']:>6} | loss {record['loss']:.4f}{mtp} | lr {record['lr']:.2e} | "
            f"grad_norm {record['grad_norm']:.3f} | {record['step_time_s'] * 1000:.0f} ms | "
            f"{record['tokens_per_s']:,.0f} tok/s")
    if record.get("mfu") is not None:
        line += f" | mfu {100 * record['mfu']:.1f}%"
    line += f" | mem {record['peak_mem_bytes'] / 2**30:.2f} GiB"
    if record["skipped"]:
        line += " | skipped (non-finite)"
    if eta_s is not None:
        line += f" | eta {tqdm.format_interval(eta_s)}"
    if "val_loss" in record:
        line += f" | val_loss {record['val_loss']:.4f}{hellaswag_text(record)}"
    return line


def hellaswag_text(record: dict) -> str:
    return f" | hellaswag {record['hellaswag_acc']:.4f}" if "hellaswag_acc" in record else ""
