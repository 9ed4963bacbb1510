"""The training loop: one optimizer step = one run of the pipeline schedule over this dp rank's micro-batches,
then the cross-stage gradient steps (tied embedding, global norm, clipping), then AdamW.

Loss scale: every micro-batch's loss is its token mean divided by the number of micro-batches, and DDP averages
over dp, so the gradient is that of the mean loss over all tokens of the global batch at every layout.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from trainer3d.parallel import pipeline

from trainer3d.checkpoint import load as resume
from trainer3d.config import BatchPlan, ConfigError, TrainConfig, parse_args, validate
from trainer3d.parallel.ddp import all_reduce_grads, clip_grads_, global_grad_norm, sync_tied_embedding_grads
from trainer3d.train.metrics import MetricsFile, device_peak_tflops, flops_per_token, peak_memory_bytes
from trainer3d.model import GPTConfig
from trainer3d.parallel.parallelize import ParallelModel, build_parallel_model, seed_rngs
from trainer3d.train.profiling import StepProfiler
from trainer3d.parallel.tensor_parallel import all_reduce, vocab_parallel_cross_entropy
from trainer3d.train.tracking import Tracker
from trainer3d.dist.topology import (
    Heartbeat, LaunchEnv, LayoutError, Topology, default_device, init_distributed, inject_fault, report_failure
)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to lr, then cosine decay to min_lr at max_steps (GPT-2 / nanoGPT)."""
    min_lr = cfg.lr / 10 if cfg.min_lr is None else cfg.min_lr
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return min_lr + 0.5 * (1 + math.cos(math.pi * min(1.0, progress))) * (cfg.lr - min_lr)


def build_optimizer(pm: ParallelModel, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices (linear weights, embeddings), none on biases and LayerNorm gains."""
    params = list(pm.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8)


class DynamicLossScale:
    """fp16 loss scaling. The overflow check is the global grad norm, which every rank already shares, so all
    stages and replicas skip the same steps."""

    def __init__(self, init: float = 2.0**16, growth_interval: int = 1000):
        self.scale, self.growth_interval, self.good_steps = init, growth_interval, 0

    def update(self, finite: bool) -> None:
        if not finite:
            self.scale, self.good_steps = max(self.scale / 2, 1.0), 0
        else:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= 2


class Trainer:
    def __init__(
        self,
        cfg: TrainConfig,
        topo: Topology,
        device: torch.device,
        mcfg: GPTConfig,
        plan: BatchPlan,
        full_value=None,
    ):
        spec = None  # a DeepSpeed JSON: ZeRO engines are the dp axis (zero.py); its batch, lr, clip, precision win
        if cfg.deepspeed_config is not None:
            from trainer3d.zero.config import resolve_deepspeed

            spec = resolve_deepspeed(cfg, topo.layout)
            cfg, plan = spec.cfg, spec.plan
        self.cfg, self.topo, self.device, self.mcfg, self.plan = cfg, topo, device, mcfg, plan
        self.precision = cfg.resolved_precision(device.type)
        self.pm = build_parallel_model(
            mcfg, topo, device, cfg.schedule, cfg.virtual_stages, cfg.seed, full_value=full_value,
            wrap_data_parallel=spec is None,
        )
        seed_rngs(cfg.seed, topo)
        self.zero = None
        if spec is not None:
            from trainer3d.zero.engine import ZeroDataParallel

            self.zero = ZeroDataParallel(spec, self.pm, topo, device, verbose=cfg.verbose)
        self.loss_scale = DynamicLossScale() if self.precision == "fp16" else None
        compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision, torch.float32)
        activations = compute if self.zero else torch.float32  # DeepSpeed casts the module; autocast does not
        vocab_shard = self.pm.padded_vocab // topo.layout.tp
        self.schedule = pipeline.build_schedule(
            self.zero.engines if self.zero else self.pm.modules,
            self.pm.stage_ids,
            self.pm.n_stages,
            cfg.schedule,
            plan.micro_batches,
            self._loss_fn,
            topo.pp_group,
            device,
            shapes=lambda i: pipeline.stage_shapes(
                i, self.pm.n_stages, plan.micro_batch_size, cfg.seq_len, mcfg.n_embd, vocab_shard, activations, compute
            ),
            stage_cls=self.zero.stage_cls if self.zero else PipelineStage,
        )
        self.optimizer = build_optimizer(self.pm, cfg) if self.zero is None else None  # ZeRO: one per engine
        self.step = 0
        self.logging_rank = topo.global_rank(self.pm.last_stage_pp_rank, 0, 0)
        self.is_logging_rank = dist.get_rank() == self.logging_rank

    # ---- values and optimizer state, for checkpoint.py (collective over dp under ZeRO: same params, same order) ---
    def param_value(self, param: torch.nn.Parameter) -> torch.Tensor:
        """This rank's tp shard of `param`, full over dp, in fp32 (under ZeRO: its fp32 master copy)."""
        return self.zero.full_param(param) if self.zero else param.data

    def optimizer_state_of(self, param: torch.nn.Parameter) -> dict[str, torch.Tensor]:
        """This rank's tp shard of `param`'s optimizer state, full over dp (AdamW: exp_avg, exp_avg_sq, step)."""
        if self.zero:
            return self.zero.optimizer_state_of(param)
        return {k: v for k, v in self.optimizer.state.get(param, {}).items() if torch.is_tensor(v)}

    def load_param_states(self, items) -> None:
        """Load a checkpoint's optimizer state (and, where the optimizer keeps its own fp32 master copy, the value)
        of each (parameter, read_state, read_value): the readers read lazily, so the engine picks the order and
        the DDP path, whose parameters were built from these values already, never reads them twice."""
        if self.zero:
            return self.zero.load_param_states(items)
        for param, read_state, _ in items:
            state = read_state()
            if state:
                self.optimizer.state[param] = {
                    k: v.to(torch.float32) if k == "step" else v.to(device=param.device, dtype=param.dtype)
                    for k, v in state.items()
                }

    # ---- one step --------------------------------------------------------------------------------------------
    def _loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        per_token = vocab_parallel_cross_entropy(
            logits, targets, self.topo.tp_group, self.pm.vocab_start, self.mcfg.vocab_size
        )
        scale = self.loss_scale.scale if self.loss_scale else 1.0
        return per_token.mean() * (scale / self.plan.micro_batches)

    def _autocast(self):
        if self.precision == "fp32" or self.zero is not None:  # DeepSpeed casts the parameters itself
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)

    def _run_schedule(self, batch: torch.Tensor, train: bool) -> float:
        """Run the pipeline over this rank's share of the global batch; return the global mean loss."""
        batch = batch.to(self.device, non_blocking=True)
        args = (batch[:, :-1].contiguous(),) if self.pm.has_first else ()
        kwargs = {"target": batch[:, 1:].contiguous()} if self.pm.has_last else {}
        losses: list[torch.Tensor] = []
        with self._autocast():
            if train:
                self.schedule.step(*args, losses=losses, return_outputs=False, **kwargs)
            else:
                with torch.no_grad():
                    self.schedule.eval(*args, losses=losses, **kwargs)
        # One rank per dp replica (last stage, tp rank 0) contributes its replica's mean; the world sums.
        local = torch.zeros((), device=self.device)
        if self.pm.has_last and self.topo.tp_rank == 0:
            scale = self.loss_scale.scale if self.loss_scale else 1.0
            local = torch.stack([x.detach().float() for x in losses]).sum() / scale
        return all_reduce(local, self.topo.world_group).item() / self.topo.layout.dp

    def train_step(self, batch: torch.Tensor) -> dict:
        """One optimizer step on this dp rank's rows of the global batch ([local_batch, seq_len + 1])."""
        if self.zero is not None:
            return self.zero.train_step(self, batch)
        modules = self.pm.modules
        for m in modules:
            m.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._run_schedule(batch, train=True)

        if not self.pm.ddp:
            all_reduce_grads(list(self.pm.parameters()), self.topo.dp_group)
        sync_tied_embedding_grads(modules, self.topo.embedding_group)
        if self.loss_scale:
            grads = [p.grad for p in self.pm.parameters() if p.grad is not None]
            torch._foreach_mul_(grads, 1.0 / self.loss_scale.scale)
        norm = global_grad_norm(modules, self.topo.tp_rank, self.topo.mp_group)
        finite = math.isfinite(norm.item())
        lr = lr_at(self.step, self.cfg)
        skipped = not finite
        if finite:
            clip_grads_(modules, norm, self.cfg.grad_clip)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
        if self.loss_scale:
            self.loss_scale.update(finite)
        self.step += 1
        record = {"step": self.step, "loss": loss, "lr": lr, "grad_norm": norm.item()}
        if self.loss_scale:
            record.update(loss_scale=self.loss_scale.scale, skipped=skipped)
        record.update(self.memory_report())
        return record

    def memory_report(self) -> dict:
        """Bytes this rank holds of parameters, gradients and optimizer states, and how much of each is offloaded."""
        from trainer3d.zero.engine import ddp_memory

        return self.zero.memory() if self.zero else ddp_memory(self.pm.modules, self.optimizer, self.device)

    def evaluate(self, batches) -> float:
        for m in self.pm.modules:
            m.eval()
        losses = [self._run_schedule(b, train=False) for b in batches]
        return sum(losses) / max(1, len(losses))


# ---- the entry point -----------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    from trainer3d.data import DataConfig, DataError, BatchLoader, build_token_blocks, val_batches

    cfg = parse_args(argv)
    env = LaunchEnv.from_environ()
    try:
        layout, plan = validate(cfg, env.world_size)  # before any process group: bad layouts fail here
    except (ConfigError, LayoutError) as e:
        if env.rank == 0:
            print(f"trainer3d: error: {e}", file=sys.stderr)
        return 2
    device = default_device(env.local_rank)
    init_distributed(env, device, timeout_s=cfg.dist_timeout)
    Heartbeat().beat(0)
    try:
        topo = Topology(layout, last_stage_pp_rank=pipeline.last_stage_pp_rank(cfg.schedule, layout.pp))
        data_cfg = DataConfig(
            data=cfg.data,
            data_config=cfg.data_config,
            split=cfg.data_split,
            text_field=cfg.text_field,
            tokenizer=cfg.tokenizer,
        )
        blocks = local_leader_first(env, lambda: build_token_blocks(data_cfg, cfg.seq_len))
        mcfg = cfg.gpt_config(blocks.vocab_size)
        start = resume.prepare(cfg, mcfg, topo)  # --resume / --init-from-hf: checked before anything is built
        trainer = Trainer(cfg, topo, device, mcfg, plan, full_value=start.full_value)
        loader = BatchLoader(blocks, plan.global_batch, topo.dp_rank, layout.dp, cfg.seed)
        resume.apply(start, trainer, loader)  # optimizer, step, data position, RNG, loss scale
        run(trainer, loader, lambda: val_batches(blocks, plan.global_batch, topo.dp_rank, layout.dp, cfg.eval_batches))
    except (DataError, ConfigError) as e:  # ConfigError: also checkpoint.CheckpointError
        if env.rank == 0:
            print(f"trainer3d: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a collective failed (a peer died, or hung past --dist-timeout): name it
        if env.world_size > 1:
            report_failure(env.rank, e)
        raise
    finally:
        dist.destroy_process_group()
    return 0


def local_leader_first(env: LaunchEnv, build):
    """Run `build` on each node's local rank 0 (it tokenizes and fills the cache), then on the other ranks
    (they read the cache). An error on a leader reaches every rank, so nobody waits at the barrier."""
    from trainer3d.data import DataError

    result, error = None, None
    if env.local_rank == 0:
        try:
            result = build()
        except DataError as e:
            error = str(e)
    errors = [None] * env.world_size
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise DataError(first)
    return result if env.local_rank == 0 else build()


def run(trainer: Trainer, loader, make_val_batches) -> list[dict]:
    """Train to max_steps, logging on one rank: console, progress bar and metrics.jsonl."""
    from tqdm import tqdm

    cfg, topo, plan = trainer.cfg, trainer.topo, trainer.plan
    log = trainer.is_logging_rank
    verbose = log or cfg.verbose
    tokens_per_step = plan.global_batch * cfg.seq_len
    flops_tok = flops_per_token(trainer.mcfg, cfg.seq_len)
    peak = device_peak_tflops(trainer.device, trainer.precision, cfg.peak_tflops)
    saver = resume.Checkpointer(trainer, loader, cfg.out_dir, cfg.save_every, cfg.keep_last, log)
    metrics = MetricsFile(cfg.out_dir, enabled=log, append=trainer.step > 0)  # resumed: continue the file
    tracker = Tracker(trainer)  # W&B, on the logging rank only
    profiler = StepProfiler(cfg.profile_steps, cfg.max_steps, cfg.out_dir, dist.get_rank(), trainer.device)
    heartbeat = Heartbeat()
    if verbose:
        n_params = trainer.mcfg.num_params()
        print(
            f"[trainer3d] {topo.layout} schedule={cfg.schedule} stages={trainer.pm.n_stages} "
            f"layers/stage={[len(r) for r in trainer.pm.layer_ranges]} micro-batches={plan.micro_batches}×"
            f"{plan.micro_batch_size} global-batch={plan.global_batch} seqs ({tokens_per_step} tokens) "
            f"model={cfg.model} ({n_params / 1e6:.1f}M params) precision={trainer.precision} device={trainer.device}",
            flush=True,
        )
    mem = trainer.memory_report()  # at start; every step record carries it too (metrics.jsonl)
    if verbose:
        mib = lambda k: f"{mem[k + '_bytes'] / 2**20:.1f} MiB ({mem[k + '_offloaded_bytes'] / 2**20:.1f} offloaded)"  # noqa: E731
        dp_axis = f"ZeRO-{trainer.zero.spec.stage}" if trainer.zero else "DDP"
        print(f"[trainer3d] rank {dist.get_rank()} memory ({dp_axis}): params {mib('param')}, grads {mib('grad')}, "
              f"optimizer states {mib('optim')}", flush=True)
    history = []
    if cfg.eval_every and trainer.step == 0:  # the starting point of the validation curve
        val = trainer.evaluate(make_val_batches())
        record0 = {"step": 0, "val_loss": val, "val_ppl": math.exp(min(val, 50.0))}
        metrics.write(record0)
        tracker.log(record0)
        if log:
            print(f"step      0 | val_loss {val:.4f}", flush=True)
    # In a log file (SLURM, nohup) a bar redrawn every step is a wall of \r-joined updates: redraw every 30 s there.
    bar = tqdm(total=cfg.max_steps, initial=trainer.step, disable=not log, dynamic_ncols=True, unit="step",
               mininterval=0.1 if sys.stderr.isatty() else 30.0)
    while trainer.step < cfg.max_steps:
        heartbeat.beat(trainer.step + 1)
        profiler.start(trainer.step + 1)
        t0 = time.perf_counter()
        record = trainer.train_step(loader.next_batch())
        dt = time.perf_counter() - t0
        profiler.stop(trainer.step)
        tps = tokens_per_step / dt
        record.update(
            tokens=trainer.step * tokens_per_step,
            step_time_s=dt,
            tokens_per_s=tps,
            tflops_per_device=tps * flops_tok / topo.layout.world_size / 1e12,
            mfu=(tps * flops_tok / topo.layout.world_size / (peak * 1e12)) if peak else None,
            peak_mem_bytes=peak_memory_bytes(trainer.device),
        )
        last = trainer.step == cfg.max_steps
        if (cfg.eval_every and trainer.step % cfg.eval_every == 0) or last:
            val = trainer.evaluate(make_val_batches())
            record.update(val_loss=val, val_ppl=math.exp(min(val, 50.0)))
        history.append(record)
        metrics.write(record)
        tracker.log(record)
        inject_fault(trainer.step, dist.get_rank())  # test-only (TRAINER3D_FAULT); a no-op otherwise
        bar.update(1)
        bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{tps:,.0f}", refresh=False)
        if log and (trainer.step % cfg.log_every == 0 or last or trainer.step == 1):
            line = (
                f"step {trainer.step:>6} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
                f"grad_norm {record['grad_norm']:.3f} | {dt * 1000:.0f} ms | {tps:,.0f} tok/s"
            )
            if record.get("mfu") is not None:
                line += f" | mfu {100 * record['mfu']:.1f}%"
            line += f" | mem {record['peak_mem_bytes'] / 2**30:.2f} GiB"
            fd = bar.format_dict  # the ETA in the step lines too, for log files: mean step time of this run so far
            if not last and fd["n"] > fd["initial"]:
                eta = fd["elapsed"] / (fd["n"] - fd["initial"]) * (cfg.max_steps - trainer.step)
                line += f" | eta {tqdm.format_interval(eta)}"
            if "val_loss" in record:
                line += f" | val_loss {record['val_loss']:.4f}"
            bar.write(line)
        if saver.after_step():  # checkpoint when due; True after SIGTERM/SIGUSR1: saved, every rank stops here
            break
    saver.close()
    bar.close()
    metrics.close()
    profiler.close()
    tracker.finish()
    return history


if __name__ == "__main__":
    sys.exit(main())
