"""One optimizer step = one run of the pipeline schedule over this dp rank's micro-batches, then the data-parallel
engine's step (dp reduction, tied embedding, global norm, clip, AdamW): DDP or ZeRO alike, through one interface.

Loss scale: every micro-batch's loss is the sum over its supervised targets times dp·cp / (the supervised targets of
the whole global batch, which the Batch carries), and the engine averages over dp·cp, so the gradient is that of the
mean loss over the global batch's supervised tokens at every layout, packing and accumulation (data/batch.py).

Host syncs: the step's loss stays on the device and goes to the engine's step, which reads it together with the
global norm in the step's one device-to-host transfer (parallel/engine.py: read_scalars).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from trainer3d.data.batch import Batch, document_ids, real_inputs
from trainer3d.distributed.collectives import all_reduce
from trainer3d.distributed.topology import Topology
from trainer3d.errors import TrainingError
from trainer3d.models.moe import expert_casts_cached
from trainer3d.optim import DynamicLossScale, lr_at
from trainer3d.parallel.ddp import DDPEngine
from trainer3d.parallel.dsa import install_dsa
from trainer3d.parallel.engine import EngineFactory
from trainer3d.parallel.moe_balance import MoEBalance
from trainer3d.parallel.mtp import install_mtp
from trainer3d.parallel.parallelize import parallelize
from trainer3d.parallel.cross_entropy import vocab_parallel_cross_entropy
from trainer3d.train.dpo import DPO
from trainer3d.train.setup import RunSetup
from trainer3d.train.step_scalars import StepScalars
from trainer3d.train.stragglers import WorkClock
from trainer3d.zero.engine import zero_engine_factory

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Trainer:
    def __init__(self, setup: RunSetup, topo: Topology, device: torch.device, mcfg, shard_value=None,
                 boundary: int | None = None):
        """`boundary`: the token that opens a document (the tokenizer's end-of-text), which --document-mask and
        --reset-position-ids need."""
        cfg = setup.cfg
        if cfg.uses_documents and boundary is None:
            raise TrainingError("--document-mask and --reset-position-ids need the end-of-text token that separates "
                                "documents, and this run's data names none.")
        self.cfg, self.topo, self.device, self.mcfg, self.plan = cfg, topo, device, mcfg, setup.plan
        self.deepspeed = setup.deepspeed  # the resolved DeepSpeed JSON, or None
        self.precision = cfg.resolved_precision(device.type)
        self.loss_scale = DynamicLossScale() if self.precision == "fp16" else None
        if setup.deepspeed is not None:  # the data-parallel engine: chosen here, once
            engine_factory = zero_engine_factory(setup.deepspeed, topo, device, verbose=cfg.verbose)
        else:
            engine_factory = EngineFactory(lambda stages: DDPEngine(stages, topo, device, cfg))
        self.parallel_model = parallelize(
            mcfg, topo, device, cfg, plan=setup.plan, engine_factory=engine_factory, loss_fn=self._loss_fn,
            compute_dtype=COMPUTE_DTYPES[self.precision], shard_value=shard_value, boundary=boundary,
        )
        self.engine, self.schedule = self.parallel_model.engine, self.parallel_model.schedule
        self.step = 0
        self.hf_source: dict | None = None  # what an export copies from the --init-from-hf directory (hf_source.py)
        self.lora: dict | None = None  # a LoRA run's settings and base, as its checkpoints record them (lora_base.py)
        # the MoE routing's losses and loads
        self.balance = MoEBalance(self, self.parallel_model.stages) if mcfg.moe is not None else None
        if self.balance is not None:
            self.parallel_model.listeners.append(self.balance)  # told each micro-batch: its padding
        self.mtp = install_mtp(self)  # multi-token prediction's targets and losses (parallel/mtp.py), or None
        self.dsa = install_dsa(self)  # DeepSeek Sparse Attention's indexer loss (parallel/dsa.py), or None
        self.objective = DPO(self) if cfg.objective == "dpo" else None  # a pair loss in the token loss's place
        self.boundary = boundary
        self.logging_rank = topo.global_rank(topo.last_stage_pp_rank, 0, 0)
        self.is_logging_rank = dist.get_rank() == self.logging_rank
        self._reduction = None  # what takes the loss's place during one run_pass (None: the run's loss)
        self._weight = 1.0  # of a supervised target's loss in the running pass: dp·cp / the global batch's targets
        self.clock = WorkClock(self.parallel_model.stages, device)  # this rank's step time (stragglers.py)

    def token_losses(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-token cross-entropy from this rank's vocab shard of the logits (collective over tp); where gradients
        flow, the logits' storage becomes their gradient (parallel/cross_entropy.py)."""
        return vocab_parallel_cross_entropy(
            logits, targets, self.topo.tp_group, self.parallel_model.vocab_start, self.mcfg.vocab_size,
            compiled=self.cfg.compiled_backend
        )

    def _loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self._reduction is not None:  # a forward-only pass with its own reduction (forward_only)
            return self._reduction(logits, targets)
        scale = self.loss_scale.scale if self.loss_scale else 1.0
        if self.objective is not None:
            return self.objective.loss(logits, targets, scale * self._weight)
        supervised = targets >= 0  # the Batch's unsupervised targets are negative (_run_schedule)
        losses = torch.where(supervised, self.token_losses(logits, targets.clamp(min=0)), 0.0)
        if self.mtp is None or not self.mtp.in_pass:
            return losses.sum() * (scale * self._weight)
        T = targets.shape[1] // (1 + self.mtp.depth)  # the main targets, then each depth's (parallel/mtp.py)
        return self.mtp(losses[:, :T].sum() * (scale * self._weight), losses[:, T:], scale)

    @contextlib.contextmanager
    def _autocast(self):
        """The step's autocast region; the experts' casts are cached for it as autocast caches the dense weights'."""
        if self.precision == "fp32" or self.engine.casts_module:
            yield
            return
        with torch.autocast(self.device.type, dtype=COMPUTE_DTYPES[self.precision]), expert_casts_cached():
            yield

    def run_pass(self, inputs: torch.Tensor, targets: torch.Tensor, train: bool,
                 documents: torch.Tensor | None = None, reduction=None) -> list[torch.Tensor]:
        """One run of the pipeline schedule over this dp rank's rows, inputs [local_batch, seq_len] (whole sequences:
        under context parallelism this rank takes its tokens of them): the one pass of the training step, evaluation,
        forward_only and trainer3d.engine. `reduction(logits shard, targets micro-batch)` takes the loss's place
        (None: the run's loss); `targets` may then have any trailing shape. `documents`: each input token's document,
        where the data knows it. Returns what the loss (or reduction) gave for each micro-batch on the last stage's
        ranks, [] elsewhere; every rank of the layout calls it (pipeline, tp and ZeRO-3 exchanges)."""
        sequence = self.parallel_model.sequence
        if sequence is not None:
            sequence.begin_pass(inputs, self.plan.micro_batches, documents)
            depths = self.mtp.depth if self.mtp is not None and self.mtp.in_pass else 0  # (targets of each MTP depth)
            inputs, targets = sequence.split(inputs), sequence.split(targets, blocks=1 + depths)
        args = (inputs.to(self.device, non_blocking=True).contiguous(),) if self.parallel_model.has_first else ()
        has_last = self.parallel_model.has_last
        kwargs = {"target": targets.to(self.device, non_blocking=True).contiguous()} if has_last else {}
        losses: list[torch.Tensor] = []
        self._reduction = reduction
        try:
            with self._autocast():
                if train:
                    self.schedule.step(*args, losses=losses, return_outputs=False, **kwargs)
                else:
                    with torch.no_grad():
                        self.schedule.eval(*args, losses=losses, return_outputs=False, **kwargs)
        finally:
            self._reduction = None
        return losses

    def _run_schedule(self, batch: Batch | torch.Tensor, train: bool, stop_requested: bool = False,
                      data_s: float = 0.0):
        """Run the pipeline over this rank's share of the global batch; return the global mean loss over its
        supervised targets, a float64 device scalar on every rank, the world's count of stop requests
        (`stop_requested` summed in the same all-reduce, so agreeing on a stop costs no collective of its own) and,
        training, every rank's step time in its own slot of that all-reduce (WorkClock: `data_s` and its forwards;
        None in evaluation); none is read here."""
        batch = batch if isinstance(batch, Batch) else Batch(batch)
        tokens, targets = batch.tokens, batch.tokens[:, 1:]
        if batch.supervised is not None:
            targets = targets.masked_fill(~batch.supervised, -1)
        count = batch.targets if batch.targets is not None else self.plan.global_batch * self.cfg.seq_len
        if self.objective is not None:  # DPO: the mean over the global batch's pairs (padding-free: counted here)
            targets = self.objective.targets(batch, targets)
            count = self.objective.pairs
            self.objective.begin_pass()
        self._weight = self.topo.layout.dp_cp / max(1, count)
        documents = batch.documents[:, :-1] if batch.documents is not None else None
        if train:
            self.clock.begin(data_s)
        if train and self.balance is not None:  # padding never counts in the balance (its real tokens' mask)
            inputs = batch.inputs if batch.inputs is not None else self.plan.global_batch * self.cfg.seq_len
            self.balance.begin_pass(real_inputs(batch), inputs)
        mtp = self.mtp if train else None
        if mtp is not None:  # the MTP depths' targets follow the main ones; the last stage gets the next tokens
            token_documents = self.documents_of(batch.tokens, batch.documents)
            targets = mtp.begin_pass(tokens, targets, token_documents, self.plan.micro_batches,
                                     whole=batch.supervised is None)
        try:
            losses = self.run_pass(tokens[:, :-1], targets, train, documents)
        finally:
            if mtp is not None:
                mtp.end_pass()
        # One rank per dp replica and context shard (last stage, tp rank 0) contributes its targets' share (and its
        # MTP depths' shares); the world sums. Training, each rank also puts its step time in its own slot after them.
        scalars = self.step_scalars(train)
        local = scalars.host(self.device, stop_requested, self.topo.rank, self.clock.seconds() if train else 0.0)
        if self.parallel_model.has_last and self.topo.tp_rank == 0:
            scale = self.loss_scale.scale if self.loss_scale else 1.0
            scalars.fill(local, torch.stack([x.detach().float() for x in losses]).sum() / scale,
                         mtp.sums if mtp is not None else None,
                         self.objective.sums if self.objective is not None else None)
        loss, stop, extra = scalars.split(all_reduce(local, self.topo.world_group), self.topo.layout.dp_cp)
        return loss, stop, extra if train else None

    def step_scalars(self, train: bool) -> StepScalars:
        """The layout of the step's summed numbers: training's MTP depths, the objective's sums, the ranks' times."""
        return StepScalars(depths=self.mtp.depth if self.mtp is not None and train else 0,
                           objective=len(self.objective.sums) if self.objective is not None else 0,
                           ranks=self.topo.layout.world_size if train else 0)

    def documents_of(self, tokens: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor | None:
        """[B, seq_len + 1] each token's document where the rows' documents are known (`documents`, stored with the
        rows or given by the caller, or opened by the boundary token under --document-mask / --reset-position-ids),
        else None."""
        if documents is not None:
            return documents
        return document_ids(tokens, self.boundary) if self.cfg.uses_documents else None

    def train_step(self, batch: Batch | torch.Tensor, stop_requested: bool = False, data_s: float = 0.0) -> dict:
        """One optimizer step on this dp rank's rows of the global batch (a Batch, or its tokens [local_batch,
        seq_len + 1] when every target is supervised); one
        device-to-host read (the engine's, for the norm, the loss, the stop requests and the ranks' step times).
        `stop_requested`: this rank was asked to stop (SIGTERM); the record's "stop" says whether any rank was.
        `data_s`: the seconds this rank took to fetch `batch`, part of its step time (`rank_step_times`)."""
        self.engine.train()
        self.engine.zero_grad()
        loss, stop, times = self._run_schedule(batch, train=True, stop_requested=stop_requested, data_s=data_s)
        result, lr = self.optimizer_step(loss, stop, times)
        depths, sums, times = self.step_scalars(train=True).unpack(result.extra)
        record = {"step": self.step, "loss": result.loss, "lr": lr, "grad_norm": result.grad_norm,
                  "skipped": not result.stepped, "stop": result.stop, "rank_step_times": times}
        if self.objective is not None:
            record.update(self.objective.record(sums))
        if depths:  # the mean over depths of L_k (the loss trained is loss + --mtp-loss-coef × this)
            record["mtp_loss"] = sum(depths) / len(depths)
        if self.loss_scale:
            record.update(loss_scale=self.loss_scale.scale)
        if self.balance is not None:  # one all-reduce and one read of the step's routing statistics
            record.update(self.balance.end_step(result.stepped))
        if self.dsa is not None:  # and of the indexers' loss
            record.update(self.dsa.end_step())
        record.update(self.engine.memory())  # sizes only: no device read
        return record

    def optimizer_step(self, loss: torch.Tensor, stop: torch.Tensor, extra: torch.Tensor | None = None,
                       lr: float | None = None):
        """After a step's backward: the engine's step at the schedule's lr, or at `lr` where a caller keeps its own
        schedule (`loss`, `stop`, `extra`: device tensors it reads in its one transfer), fp16's loss scale updated, a
        non-finite step refused under --on-nonfinite stop, the step counted. (StepResult, lr); train_step's and
        trainer3d.engine's."""
        lr = lr_at(self.step, self.cfg) if lr is None else lr
        grad_scale = 1.0 / self.loss_scale.scale if self.loss_scale else 1.0
        result = self.engine.step(lr, self.cfg.grad_clip, grad_scale, loss=loss, stop=stop, extra=extra)
        if self.loss_scale:
            self.loss_scale.update(result.stepped)
        elif not result.stepped and self.cfg.on_nonfinite == "stop":
            raise TrainingError(
                f"Step {self.step + 1} has a loss of {result.loss} and a gradient norm of {result.grad_norm}, so it was "
                f"not applied and the run stops with the weights and checkpoints of step {self.step}: lower --lr or "
                "check the data, then resume" + ("." if self.deepspeed else " (--on-nonfinite skip trains past such "
                                                 "steps)."))
        self.step += 1
        return result, lr

    def forward_only(self, inputs: torch.Tensor, targets: torch.Tensor, reduction,
                     documents: torch.Tensor | None = None) -> list[torch.Tensor]:
        """A forward pass without gradients (eval mode) over this dp rank's rows, inputs [local_batch, seq_len], in
        which `reduction(logits_shard, targets_micro_batch)` takes the loss's place: one pipeline for every pass
        with a reduction of its own (HellaSwag's per-row losses, the logits of a sampled position: downstream.py).
        `targets` may have any trailing shape; only the reduction reads it. Returns the reduction's results on the
        last stage's ranks, [] elsewhere. Every rank of the layout must call it (pipeline, tp and ZeRO-3 exchanges).
        `documents` [local_batch, seq_len]: each input token's document where the rows know it (run_pass's)."""
        self.engine.train(False)
        return self.run_pass(inputs, targets, train=False, documents=documents, reduction=reduction)

    def evaluate(self, batches) -> float:
        """The mean loss over the supervised targets of all `batches` (Batches or token rows)."""
        self.engine.train(False)
        losses, counts = [], []
        for b in batches:
            losses.append(self._run_schedule(b, train=False)[0])
            counts.append(b.targets if isinstance(b, Batch) and b.targets is not None else 1)
        values = torch.stack(losses).tolist() if losses else []  # one device read for the whole evaluation
        return sum(v * c for v, c in zip(values, counts)) / max(1, sum(counts))
