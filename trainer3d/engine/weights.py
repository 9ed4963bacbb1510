"""The engine's weight stream to an inference engine: every weight under its Hugging Face name, whole, on every rank,
in buckets of a size the caller sets, in the caller's dtype and on its device.

Each element of the model has one writer in the world (the pieces a checkpoint would write: checkpoint/save.py's
rule, which spreads the writing of replicated values over their holders), so a unit (a canonical tensor, or one
expert's block of a stacked expert weight: HF's per-expert tensors) is whole once every writer's pieces reach every
rank. Per bucket, each writer broadcasts its pieces of the bucket's units in one flat buffer of the caller's dtype;
every rank places them into the units and yields their HF tensors. A rank receives each element once and sends only
what it writes: (model bytes in dtype - its own pieces) in, no world-wide all-reduce of fp32 copies (the stream until
2026-12-07), and it holds one bucket (or one unit, where a unit is larger) at a time. Which rank writes which piece is
gathered once per engine (the plan). A unit every rank holds whole (DDP's replicas; ZeRO-1/2's parameters where they
are the fp32 master or in the stream's dtype, so that they are the master as the stream would cast it) is read where
it is: the value its writers would have sent, and nothing moves (until 2026-12-08 a DDP rank received three quarters
of the model at dp 4).

A LoRA run's adapters are units too, streamed first and kept: each targeted weight is yielded merged (W + s · B A, in
fp32, then the caller's dtype), or with `adapters` only the adapters, under PEFT's names (checkpoint/peft.py), or
with `base` only the base, unmerged (the adapters then not even gathered).
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import torch
import torch.distributed as dist

from trainer3d.checkpoint.hf import hf_tables, hf_tensors
from trainer3d.checkpoint.hf_save import by_size
from trainer3d.checkpoint.lora_base import merged
from trainer3d.checkpoint.peft import peft_tensors
from trainer3d.checkpoint.save import parameter_pieces
from trainer3d.distributed.collectives import all_reduce
from trainer3d.models import canonical_shapes, canonical_tables, family_of
from trainer3d.parallel.lora import LoRASpec, adapter_shapes
from trainer3d.parallel.parallelize import named_full_params

MAX_DIMS = 4  # a piece's box in a unit: up to this many dims (padded)


@dataclasses.dataclass
class Unit:
    name: str  # canonical
    expert: int | None  # an expert's block of a stacked expert weight, or None: the whole tensor
    shape: tuple[int, ...]


class WeightStream:
    """One engine's stream: its units and which rank writes which piece of each (collective to build)."""

    def __init__(self, trainer, device: torch.device):
        self.trainer, self.device, mcfg = trainer, device, trainer.mcfg
        self.tables = hf_tables(mcfg)
        adapter = family_of(mcfg).hf
        self.lora = LoRASpec.of(trainer.cfg)
        lora_units = adapter_shapes(mcfg, self.lora) if self.lora is not None else {}
        self.units: list[Unit] = [Unit(name, None, shape) for name, shape in lora_units.items()]  # (first: kept)
        self.n_adapters = len(self.units)
        for name, shape in canonical_shapes(mcfg).items():
            parts = adapter.parts(mcfg, name)
            experts = sorted({p.expert for p in parts}) if parts[0].expert is not None else [None]
            self.units += [Unit(name, e, tuple(shape) if e is None else tuple(shape[1:])) for e in experts]
        self.table_shapes = {n: s for n, s in canonical_tables(mcfg).items() if n in self.tables}
        self.held = named_full_params(trainer.parallel_model)
        self.full_shapes = {**lora_units, **canonical_shapes(mcfg)}
        self.everywhere: dict[torch.dtype, set[int]] = {}  # by dtype: units every rank reads from its own parameter
        self.mine = self._my_pieces()
        self.plan = self._gather_plan()  # [n, 2 + 2 * MAX_DIMS]: (rank, unit, start..., size...) of every piece

    def _local(self, unit: Unit, dtype: torch.dtype) -> torch.Tensor | None:
        """The unit's value from this rank's own parameter where it holds the whole tensor, as its writers would send
        it in `dtype`: unpartitioned (their value, parameter_pieces'), or ZeRO-1/2's parameter beside the master's
        partition where it is fp32 (the master) or `dtype` (the master rounded as the cast rounds); else None."""
        engine, held = self.trainer.engine, self.held.get(unit.name)
        if held is None:
            return None
        p, spec, full = held[0], held[1], tuple(self.full_shapes[unit.name])
        if engine.partition_of(p, moments=False) is None:
            value = engine.param_value(p)
        elif p.dtype in (torch.float32, dtype) and p.numel() > 0:  # (ZeRO-3's parameter is empty between gathers)
            value = p.data
        else:
            return None
        if spec is not None and spec.padded is not None and value.shape[spec.dim] == spec.padded:
            value = value.narrow(spec.dim, 0, full[spec.dim])  # a whole padded vocabulary: its real rows
        if tuple(value.shape) != full:
            return None  # (split over tp or ep)
        return value if unit.expert is None else value[unit.expert]

    def held_everywhere(self, dtype: torch.dtype) -> set[int]:
        """The units every rank holds whole for a stream in `dtype` (one MIN all-reduce of a flag per unit, once per
        dtype)."""
        if dtype not in self.everywhere:
            flags = torch.tensor([float(self._local(u, dtype) is not None) for u in self.units], device=self.device)
            flags = all_reduce(flags, self.trainer.topo.world_group, dist.ReduceOp.MIN)
            self.everywhere[dtype] = {i for i, f in enumerate(flags.tolist()) if f}
        return self.everywhere[dtype]

    def _my_pieces(self) -> list[tuple[int, tuple, tuple, torch.Tensor]]:
        """(unit index, start, size, data) of each piece this rank writes, data a view of its parameter."""
        t = self.trainer
        held = self.held
        index = {(u.name, u.expert): i for i, u in enumerate(self.units)}
        out = []
        for name in dict.fromkeys(u.name for u in self.units):
            if name not in held:
                continue
            p, spec = held[name]
            for _, start, size, data, _ in parameter_pieces(t, p, spec, False, kinds=("param",)):
                if (name, None) in index:
                    out.append((index[(name, None)], tuple(start), tuple(size), data))
                    continue
                for e in range(start[0], start[0] + size[0]):  # a stacked expert weight: one piece per expert
                    out.append((index[(name, e)], tuple(start[1:]), tuple(size[1:]), data[e - start[0]]))
        return out

    def _gather_plan(self) -> torch.Tensor:
        """Every rank's pieces, on every rank: an all-gather of their (unit, box) rows, once."""
        rank, group = self.trainer.topo.rank, self.trainer.topo.world_group
        pad = lambda xs: list(xs) + [0] * (MAX_DIMS - len(xs))  # noqa: E731
        rows = torch.tensor([[rank, u] + pad(start) + pad(size) for u, start, size, _ in self.mine],
                            dtype=torch.long).reshape(-1, 2 + 2 * MAX_DIMS)
        counts = torch.zeros(dist.get_world_size(group), dtype=torch.long, device=self.device)
        counts[dist.get_group_rank(group, dist.get_rank())] = len(rows)
        counts = all_reduce(counts, group).cpu()
        padded = torch.zeros(int(counts.max()), rows.shape[1], dtype=torch.long)
        padded[:len(rows)] = rows
        gathered = [torch.zeros_like(padded, device=self.device) for _ in range(len(counts))]
        dist.all_gather(gathered, padded.to(self.device), group=group)
        return torch.cat([g.cpu()[:int(n)] for g, n in zip(gathered, counts)])

    def buckets(self, dtype: torch.dtype, bucket_bytes: int, units: range) -> list[list[int]]:
        """Consecutive `units`, each bucket at most `bucket_bytes` in `dtype` (a larger unit alone)."""
        nbytes = [torch.Size(u.shape).numel() * dtype.itemsize for u in self.units]
        return by_size(list(units), nbytes.__getitem__, bucket_bytes)

    def stream(self, dtype: torch.dtype, device, bucket_bytes: int, adapters: bool = False,
               base: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights, bucket by bucket; a LoRA run's merged, or its adapters alone, PEFT-named (`adapters`), or its
        base alone (`base`)."""
        mcfg = self.trainer.mcfg
        self.received = 0  # elements this rank received in the last stream (bench/engine_weights.py)
        held = {}  # a LoRA run's adapters, whole, fp32
        for i, tensor in self._units(range(0 if base else self.n_adapters), torch.float32, bucket_bytes):
            held[self.units[i].name] = tensor
        if adapters:
            yield from ((k, v.to(device, dtype)) for k, v in peft_tensors(mcfg, self.lora, held).items())
            return
        hf = family_of(mcfg).hf
        for i, tensor in self._units(range(self.n_adapters, len(self.units)), dtype, bucket_bytes):
            unit = self.units[i]
            if held:  # (empty with `base`: the adapters were not gathered)
                tensor = merged(mcfg, self.lora, unit.name, tensor.float(), held.__getitem__).to(dtype)
            tensor = tensor.to(device)
            yield from (hf.expert_to_hf(mcfg, unit.name, unit.expert, tensor) if unit.expert is not None
                        else hf_tensors(mcfg, unit.name, tensor, self.tables)).items()
        for name, shape in self.table_shapes.items():
            yield from hf_tensors(mcfg, name, self._table(name, shape).to(device), self.tables).items()

    def _units(self, units: range, dtype: torch.dtype, bucket_bytes: int) -> Iterator[tuple[int, torch.Tensor]]:
        """(unit index, whole tensor in `dtype` on the engine's device) of `units`, every writer's pieces broadcast
        bucket by bucket."""
        topo, local = self.trainer.topo, self.held_everywhere(dtype)
        for bucket in self.buckets(dtype, bucket_bytes, units):
            inside = {i for i in bucket if i not in local}
            full = {i: self._local(self.units[i], dtype).to(self.device, dtype, copy=True) if i in local
                    else torch.empty(self.units[i].shape, dtype=dtype, device=self.device) for i in bucket}
            rows = self.plan[torch.isin(self.plan[:, 1], torch.tensor(sorted(inside), dtype=torch.long))]
            for writer in sorted(set(rows[:, 0].tolist())):
                boxes = rows[rows[:, 0] == writer]
                numels = [int(torch.prod(b[2 + MAX_DIMS:2 + MAX_DIMS + len(self.units[int(b[1])].shape)]))
                          for b in boxes]
                if writer == topo.rank:
                    flat = torch.cat([d.reshape(-1).to(dtype) for u, _, _, d in self.mine if u in inside])
                else:
                    flat = torch.empty(sum(numels), dtype=dtype, device=self.device)
                    self.received += flat.numel()
                dist.broadcast(flat, src=writer, group=topo.world_group)
                for b, piece in zip(boxes, flat.split(numels)):
                    unit = self.units[int(b[1])]
                    n = len(unit.shape)
                    start, size = b[2:2 + n].tolist(), b[2 + MAX_DIMS:2 + MAX_DIMS + n].tolist()
                    full[int(b[1])][tuple(slice(o, o + s) for o, s in zip(start, size))] = piece.view(size)
                del flat
            for i in bucket:
                yield i, full.pop(i)

    def _table(self, name: str, shape) -> torch.Tensor:
        """A table (a router's selection bias) is replicated wherever its module is: broadcast from the lowest rank
        that holds it."""
        t = self.trainer
        held = [s.state_tables()[name] for s in t.parallel_model.stages if name in s.state_tables()]
        flag = torch.tensor([float(t.topo.rank) if held else float("inf")], device=self.device)
        first = int(all_reduce(flag, t.topo.world_group, dist.ReduceOp.MIN))
        value = held[0].float().clone() if held and t.topo.rank == first else torch.empty(shape, device=self.device)
        dist.broadcast(value, src=first, group=t.topo.world_group)
        return value
