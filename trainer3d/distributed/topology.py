"""World size -> (pp, dp, cp, tp) grid and the process groups of each axis.

tp varies fastest (adjacent ranks share a node: TP's all-reduces are the heaviest and most frequent), then cp
(context parallelism: attention's key/value exchange, the next heaviest), then dp, then pp outermost:
rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank. This is Megatron-LM's order (tp-cp-dp-pp) and, at
cp 1, DeepSpeed's `['pipe', 'data', 'model']`. The ranks of one dp×cp line hold the same parameters: gradients are
reduced, and ZeRO partitions, over it (`dp_cp_group`). Groups are built once; everything else asks the Topology.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from trainer3d.errors import LayoutError


class Coords(NamedTuple):
    pp: int
    dp: int
    tp: int
    cp: int = 0

    def label(self) -> str:
        """"pp1 dp0 cp0 tp1": how log lines name a rank's place (outermost axis first)."""
        return " ".join(f"{axis}{getattr(self, axis)}" for axis in reversed(ORDER))


ORDER = ("tp", "cp", "dp", "pp")  # THE rank order, fastest-varying axis first (the module docstring says why)


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    cp: int = 1
    ep: int = 1  # expert parallelism: experts split over ep consecutive ranks of a dp×cp line (Megatron's folding)

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def dp_cp(self) -> int:
        """Ranks holding the same parameters (one per dp replica and context shard)."""
        return self.dp * self.cp

    def stride(self, axis: str) -> int:
        """How far apart in rank two neighbours along `axis` are (ORDER: tp 1, cp tp, dp tp·cp, pp tp·cp·dp); the
        planner prices a group's links by it."""
        out = 1
        for a in ORDER[: ORDER.index(axis)]:
            out *= getattr(self, a)
        return out

    def coords(self, rank: int) -> Coords:
        return Coords(**{a: rank // self.stride(a) % getattr(self, a) for a in ORDER})

    def rank(self, pp: int, dp: int, tp: int, cp: int = 0) -> int:
        at = {"pp": pp, "dp": dp, "tp": tp, "cp": cp}
        return sum(at[a] * self.stride(a) for a in ORDER)

    @property
    def edp(self) -> int:
        """Ranks holding the same experts: the dp×cp line's ranks with the same expert-parallel rank."""
        return self.dp_cp // self.ep

    def __str__(self) -> str:
        return (f"dp{self.dp}×tp{self.tp}×pp{self.pp}" + (f"×cp{self.cp}" if self.cp > 1 else "")
                + (f" ep{self.ep}" if self.ep > 1 else ""))


def infer_layout(world_size: int, tp: int, pp: int, cp: int = 1, ep: int = 1) -> Layout:
    if tp < 1 or pp < 1 or cp < 1 or ep < 1:
        raise LayoutError(f"--tp, --pp, --cp and --ep must be at least 1 (got tp={tp}, pp={pp}, cp={cp}, ep={ep}).")
    if world_size % (tp * pp * cp):
        axes, sizes, flags = ("tp×cp×pp", f"{tp}×{cp}×{pp}", "--tp/--cp/--pp") if cp > 1 else \
            ("tp×pp", f"{tp}×{pp}", "--tp/--pp")
        raise LayoutError(
            f"World size {world_size} is not divisible by {axes} = {sizes} = {tp * cp * pp}; "
            f"launch a multiple of {tp * cp * pp} processes or change {flags}."
        )
    layout = Layout(dp=world_size // (tp * pp * cp), tp=tp, pp=pp, cp=cp)
    if layout.dp_cp % ep:
        raise LayoutError(f"--ep {ep} splits the experts over ranks carved from the {layout.dp_cp} data-parallel × "
                          f"context-parallel ranks (dp {layout.dp}, cp {cp}), so it must divide {layout.dp_cp}; "
                          "launch more processes or lower --ep.")
    return Layout(dp=layout.dp, tp=tp, pp=pp, cp=cp, ep=ep)


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher (python, torchrun, deepspeed, srun) told this process."""

    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int

    @classmethod
    def from_environ(cls) -> LaunchEnv:
        env = os.environ
        default_addr, default_port = "127.0.0.1", 29500
        if "RANK" in env:  # torchrun, deepspeed, or an sbatch that exports them
            rank, world = int(env["RANK"]), int(env.get("WORLD_SIZE", "1"))
            local = int(env.get("LOCAL_RANK", "0"))
        elif "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:  # srun, one task per GPU
            # SLURM_STEP_NUM_TASKS, not SLURM_NTASKS: a batch script or salloc shell also has SLURM_PROCID=0 and the
            # job's SLURM_NTASKS, and a plain `python` there is one process, not rank 0 of a world that never comes.
            rank, world = int(env["SLURM_PROCID"]), int(env["SLURM_STEP_NUM_TASKS"])
            local = int(env.get("SLURM_LOCALID", "0"))
            if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:  # bare `srun python ...`: derive them
                default_addr, default_port = _slurm_master(env)
        else:
            rank, world, local = 0, 1, 0
        return cls(
            rank=rank,
            local_rank=local,
            world_size=world,
            master_addr=env.get("MASTER_ADDR", default_addr),
            master_port=int(env.get("MASTER_PORT", default_port)),
        )


def _slurm_master(env) -> tuple[str, int]:
    """The first node of the step (what launch/slurm/train_gpt2.sbatch exports) and a port from the job id."""
    import subprocess

    addr = "127.0.0.1"
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if nodes:
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True, timeout=30)
            addr = out.stdout.split()[0] if out.returncode == 0 and out.stdout.split() else addr
        except (OSError, subprocess.SubprocessError):
            pass
    return addr, 20000 + int(env.get("SLURM_JOB_ID", "9500")) % 20000


def device_type() -> str:
    """The kind of device every process of this host trains on."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_device(local_rank: int) -> torch.device:
    if device_type() == "cuda":
        count = torch.cuda.device_count()
        if count == 1:  # the launcher bound one GPU per process (srun --gpus-per-task=1, --gpu-bind=single:1)
            local_rank = 0
        elif local_rank >= count:
            raise LayoutError(
                f"Local rank {local_rank} but only {count} GPUs are visible on this node; start at most {count} "
                "processes per node (--nproc-per-node / NPROC_PER_NODE / --ntasks-per-node)."
            )
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


# The timeout of every sub-group Topology builds: new_group() does not inherit the world group's (it takes
# torch's 30-minute default), so init_distributed records it here.
_group_timeout: datetime.timedelta | None = None


def init_distributed(env: LaunchEnv, device: torch.device, timeout_s: float = 600.0) -> None:
    """nccl on CUDA, gloo on CPU; a timeout on every collective so a dead peer fails the job, not hangs it."""
    global _group_timeout
    if dist.is_initialized():
        return
    _group_timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    # One process started by plain `python`: an in-memory store, so no port is needed (or can collide).
    store = (
        dist.HashStore()
        if env.world_size == 1 and "MASTER_PORT" not in os.environ
        else _tcp_store(env, _group_timeout)
    )
    dist.init_process_group(
        backend=backend,
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
        store=store,
    )


class WorldGroup:
    """An entry point's process group: made (and destroyed by `close`) here, unless the caller made one already (the
    tests run entry points inside their worlds), which is left to it with only this run's sub-groups destroyed."""

    def __init__(self, env: LaunchEnv, device: torch.device, timeout_s: float):
        self.owned = not dist.is_initialized()
        init_distributed(env, device, timeout_s=timeout_s)
        self.topology = None  # set by the entry point once built

    def close(self) -> None:
        if self.owned:
            dist.destroy_process_group()
        elif self.topology is not None:
            self.topology.destroy()


def _tcp_store(env: LaunchEnv, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store at MASTER_ADDR:MASTER_PORT: torchrun's agent hosts it (TORCHELASTIC_USE_AGENT_STORE),
    else rank 0. The agent's store outlives a restart, so its keys get a per-attempt prefix (a restarted worker that
    reads a dead attempt's keys, gloo's peer addresses, fails with "connection refused"): the restart count and the
    world size, as a node that joins an elastic job (--nnodes MIN:MAX) restarts the workers at a new size without
    counting a restart. A store of rank 0's is new every attempt and needs none (under
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 a joining node's agent, whose restart count is 0, meets the others there)."""
    host_is_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    is_master = env.rank == 0 and not host_is_agent
    store = dist.TCPStore(  # world_size on every rank: the master waits until that many clients joined
        env.master_addr, env.master_port, env.world_size, is_master, timeout=timeout, multi_tenant=True
    )
    if not host_is_agent:
        return store
    attempt = f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}-world{env.world_size}"
    return dist.PrefixStore(f"trainer3d/attempt{attempt}/", store)


class Topology:
    """This rank's coordinates and the groups of each axis. Every rank must construct it (group creation is
    collective over the world), in the same order as every other Topology built in the process."""

    def __init__(self, layout: Layout, *, last_stage_pp_rank: int, ranks: list[int] | None = None):
        """`last_stage_pp_rank`: where the last stage (the loss, a tied head's copy) lives, which the schedule decides;
        no default, since ranks that disagree on it wait on different collectives. Runs build it through
        RunSetup.topology, its one owner."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.layout = layout
        if not 0 <= last_stage_pp_rank < layout.pp:
            raise LayoutError(f"The last pipeline stage cannot live on pp rank {last_stage_pp_rank} of {layout.pp}.")
        self.last_stage_pp_rank = last_stage_pp_rank
        # `ranks`: the global ranks this grid lives on (all of them by default); tests run several
        # smaller grids inside one world.
        self.ranks = list(range(layout.world_size)) if ranks is None else list(ranks)
        if len(self.ranks) != layout.world_size or world < layout.world_size:
            raise LayoutError(f"Layout {layout} needs {layout.world_size} processes but the world has {world}.")
        global_rank = dist.get_rank() if dist.is_initialized() else 0
        self.active = global_rank in self.ranks
        self.rank = self.ranks.index(global_rank) if self.active else -1
        self.pp_rank, self.dp_rank, self.tp_rank, self.cp_rank = layout.coords(max(self.rank, 0))
        self.dp_cp_rank = self.dp_rank * layout.cp + self.cp_rank
        self.ep_rank, self.edp_rank = self.dp_cp_rank % layout.ep, self.dp_cp_rank // layout.ep
        L = layout
        every = [(p, d, c, t) for p in range(L.pp) for d in range(L.dp) for c in range(L.cp) for t in range(L.tp)]

        def lines(key) -> list[list[int]]:
            # The grid's lines along the axes `key` leaves free: ranks whose key(p, d, c, t) agree, in rank order.
            out: dict = {}
            for p, d, c, t in every:
                out.setdefault(key(p, d, c, t), []).append(L.rank(p, d, t, c))
            return list(out.values())

        self.tp_group = self._build(lines(lambda p, d, c, t: (p, d, c)))
        self.dp_group = self._build(lines(lambda p, d, c, t: (p, c, t)))
        # Without context parallelism (cp 1) there is no cp group and dp×cp is dp.
        self.cp_group = self._build(lines(lambda p, d, c, t: (p, d, t))) if L.cp > 1 else None
        self.dp_cp_group = self._build(lines(lambda p, d, c, t: (p, t))) if L.cp > 1 else self.dp_group
        # expert parallelism: experts split over ep consecutive ranks of each dp×cp line (ep_group, which exchanges
        # tokens), replicated over the line's ranks with the same ep rank (edp_group, over which their gradients
        # are reduced and ZeRO would partition them); at ep 1 the experts are replicated over the whole line.
        E = L.ep
        self.ep_group = self._build(lines(lambda p, d, c, t: (p, t, (d * L.cp + c) // E))) if E > 1 else None
        self.edp_group = self._build(lines(lambda p, d, c, t: (p, t, (d * L.cp + c) % E))) if E > 1 \
            else self.dp_cp_group
        self.pp_group = self._build(lines(lambda p, d, c, t: (d, c, t)))
        # Model-parallel group (all tp and pp peers of one dp replica and context shard): where the grad norm is summed.
        self.mp_group = self._build(lines(lambda p, d, c, t: (d, c)))
        self.world_group = self._build([list(range(L.world_size))])
        # Every tp, cp and dp rank of one pipeline rank (the ranks holding the same layers): where the global-batch
        # balance loss sums a layer's loads (parallel/moe_balance.py); the world itself without a pipeline.
        self.stage_group = self._build(lines(lambda p, d, c, t: p)) if L.pp > 1 else self.world_group
        # A tied embedding's copies live on the first stage (pp rank 0) and the last stage. One group per (dp, cp, tp).
        self.embedding_group = self._build(
            [sorted({L.rank(0, d, t, c), L.rank(last_stage_pp_rank, d, t, c)})
             for d in range(L.dp) for c in range(L.cp) for t in range(L.tp)]
        )

    def _build(self, lines: list[list[int]]):
        """Create a group for every line (collectively), return the one holding this rank."""
        mine = None
        for line in lines:
            global_ranks = [self.ranks[r] for r in line]
            group = dist.new_group(global_ranks, timeout=_group_timeout) if dist.is_initialized() else None
            if self.active and self.rank in line:
                mine = group
        return mine

    def global_rank(self, pp: int, dp: int, tp: int, cp: int = 0) -> int:
        return self.ranks[self.layout.rank(pp, dp, tp, cp)]

    def shard_coords(self, spec) -> tuple[int, int]:
        """(rank, size) along the axis a parameter is split over (its TPSpec's `axis`: tp, or ep for experts)."""
        if spec is None:
            return 0, 1
        return (self.ep_rank, self.layout.ep) if spec.axis == "ep" else (self.tp_rank, self.layout.tp)

    def shard_group(self, spec):
        """The group a parameter split by `spec` is split over."""
        return self.ep_group if spec is not None and spec.axis == "ep" else self.tp_group

    @property
    def coords_by_axis(self) -> dict[str, tuple[int, int]]:
        return {"tp": (self.tp_rank, self.layout.tp), "ep": (self.ep_rank, self.layout.ep)}

    def destroy(self) -> None:
        groups = (self.tp_group, self.cp_group, self.dp_group, self.dp_cp_group, self.ep_group, self.edp_group,
                  self.pp_group, self.mp_group, self.world_group, self.stage_group, self.embedding_group)
        for g in {g for g in groups if g is not None}:
            dist.destroy_process_group(g)

    def __repr__(self) -> str:
        return (f"Topology({self.layout}, rank={self.rank}, pp={self.pp_rank}, dp={self.dp_rank}, cp={self.cp_rank}, "
                f"tp={self.tp_rank})")
