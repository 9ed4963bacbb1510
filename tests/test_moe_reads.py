"""Host reads of one MoE layer (issue 42): its forward and backward read the host at most once, and only for what
expert parallelism cannot do without (the all-to-all's split sizes), none at ep 1 on the grouped matmul's path.

On a GPU a read is a device sync; on the CPU nothing syncs, so `HostReads` counts what would be one: the ATen ops
whose output size or value needs the data on the host (`_local_scalar_dense` behind item() and bool(), `nonzero`,
`bincount`, whose output length is the largest id, `masked_select`, `unique`, `repeat_interleave` without an
output_size, indexing with a boolean mask, which runs `nonzero` inside the kernel, copies from a device to the host),
seen by a TorchDispatchMode wherever they are called, plus the Tensor methods that read memory without any ATen op
(tolist, numpy). test_host_syncs.py counts a whole step's reads from trainer3d's own lines; this counts the layer's
inside the ops too."""

from __future__ import annotations

import copy

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers.distributed import run_world
from test_moe import SPEC, _balance, block

aten = torch.ops.aten
READ_OPS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.bincount.default,
            aten.masked_select.default, aten._unique2.default, aten.unique_dim.default,
            aten.unique_consecutive.default, aten.is_nonzero.default, aten.item.default}
MASK_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
COPIES = {aten._to_copy.default, aten.copy_.default}


class HostReads(TorchDispatchMode):
    """Counts (by name) the host reads of the code run inside it; `reads` lists them in order."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []
        self._saved = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._is_read(func, args, kwargs):
            self.reads.append(str(func))
        return func(*args, **kwargs)

    @staticmethod
    def _is_read(func, args, kwargs) -> bool:
        if func in READ_OPS:
            return True
        if func is aten.repeat_interleave.Tensor:
            return kwargs.get("output_size", args[1] if len(args) > 1 else None) is None
        if func in MASK_INDEXED:
            return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] if
                       i is not None)
        if func in COPIES:
            src = args[1] if func is aten.copy_.default else args[0]
            dst = args[0].device if func is aten.copy_.default else kwargs.get("device") or src.device
            return src.device.type != "cpu" and torch.device(dst).type == "cpu"
        return False

    def __enter__(self):
        for name in ("tolist", "numpy"):  # no ATen op behind them
            original = self._saved[name] = getattr(torch.Tensor, name)

            def counted(t, *a, _name=name, _original=original, **kw):
                self.reads.append(f"Tensor.{_name}")
                return _original(t, *a, **kw)

            setattr(torch.Tensor, name, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)


def _layer_reads(m, x: torch.Tensor) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """One forward and backward of MoE layer `m` (its observer adding the balance losses): the reads, the output and
    the input's gradient."""
    x = x.clone().requires_grad_()
    target = torch.randn(x.shape, generator=torch.Generator().manual_seed(7))
    with HostReads() as counter:
        out = m(x)
        (out * target).sum().backward()
    return counter.reads, out.detach(), x.grad


def _cases():
    """(name, hidden, capacity factor): the grouped matmul (32 floats a row), the per-expert loop (30: no 16-byte
    rows) and a capacity that drops."""
    return [("grouped", 32, None), ("loop", 30, None), ("capacity", 32, 0.5)]


def test_counter_sees_reads_inside_ops():
    """The counter itself: bincount, a boolean mask, item and tolist are reads; a gather is not."""
    x = torch.tensor([3, 1, 2])
    with HostReads() as c:
        torch.bincount(x)
        x[x > 1]
        x.sum().item()
        x.tolist()
        x.gather(0, torch.tensor([0, 2]))
        torch.repeat_interleave(x, x, output_size=6)
    assert c.reads == ["aten.bincount.default", "aten.index.Tensor", "aten._local_scalar_dense.default",
                       "Tensor.tolist"], c.reads


def test_one_process_reads_nothing_on_the_grouped_path():
    """ep 1: no read on the grouped matmul's path (before: bincount in the dispatch and in the balance's loads); the
    per-expert loop reads the sizes it loops over once, and a capacity the rows it keeps once (before: 2, and 6 with
    the capacity's bincount and boolean masks)."""
    expected = {"grouped": 0, "loop": 1, "capacity": 1}
    for name, hidden, factor in _cases():
        m = block(hidden=hidden)
        _balance([m], moe_aux_loss_coef=0.01, moe_z_loss_coef=0.001)
        m.capacity_factor = factor
        reads = _layer_reads(m, torch.randn(2, 12, hidden))[0]
        print(f"\nep 1 {name}: {reads}")
        assert len(reads) == expected[name], (name, reads)


def _ep2_reads(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from trainer3d.parallel.expert_parallel import apply_expert_parallel

    out = {}
    for name, hidden, factor in _cases():
        full = block(hidden=hidden)
        m = copy.deepcopy(full)
        apply_expert_parallel(torch.nn.ModuleList([m]), None, 0, 1, False, dist.group.WORLD, rank, world_size)
        n_local = SPEC.n_experts // world_size
        with torch.no_grad():
            for key in ("gate_up_proj", "down_proj"):
                getattr(m.experts, key).copy_(getattr(full.experts, key)[rank * n_local:(rank + 1) * n_local])
        m.gate.init_tables(torch.device("cpu"))
        for b in (m, full):
            _balance([b], moe_aux_loss_coef=0.01, moe_z_loss_coef=0.001)
            b.capacity_factor = factor
        x = torch.randn(2, 12, hidden, generator=torch.Generator().manual_seed(rank))  # each rank its own tokens
        reads, y, dx = _layer_reads(m, x)
        _, y_ref, dx_ref = _layer_reads(full, x)  # the one-process layer on this rank's tokens
        out[name] = {"reads": reads, "out": (y - y_ref).abs().max().item(), "grad": (dx - dx_ref).abs().max().item()}
    return out


def test_expert_parallel_reads_the_splits_once():
    """ep 2 (a world of 2): one read per layer, the all-to-all's split sizes, on every path (before: bincount twice
    and tolist, and the loop's sizes again); the layer's output and its input's gradient are the one-process
    layer's on the same tokens."""
    results = run_world(2, _ep2_reads, timeout=300)
    for rank, per_case in enumerate(results):
        for name, r in per_case.items():
            print(f"\nep 2 rank {rank} {name}: {r}")
            assert r["reads"] == ["Tensor.tolist"], (rank, name, r["reads"])
            assert r["out"] < 1e-5 and r["grad"] < 1e-5, (rank, name, r)
