"""The hardware the planner plans for: per-GPU memory, peak, bandwidths, and the efficiencies it assumes."""

from __future__ import annotations

from dataclasses import dataclass

# Per GPU: memory (GiB), dense bf16 peak (TFLOP/s), ring bandwidth inside a node and across nodes (GB/s per GPU).
CLUSTERS = {
    "a100-80g": dict(gpus_per_node=8, gpu_memory_gib=80, peak_tflops=312, intra_node_gbps=230, inter_node_gbps=25),
    "a100-40g": dict(gpus_per_node=8, gpu_memory_gib=40, peak_tflops=312, intra_node_gbps=230, inter_node_gbps=25),
    "h100": dict(gpus_per_node=8, gpu_memory_gib=80, peak_tflops=989, intra_node_gbps=360, inter_node_gbps=50),
    # an H100's compute and links, 141 GiB of faster HBM: FP8's casts as fitted on one (Cluster.fp8_cast_s)
    "h200": dict(gpus_per_node=8, gpu_memory_gib=141, peak_tflops=989, intra_node_gbps=360, inter_node_gbps=50,
                 fp8_cast_s=6.0e-12),
}


# --fp8: a recipe's casts and scales against rowwise's (Cluster.fp8_cast_s is rowwise's): tensorwise takes one amax
# per tensor where rowwise takes one per row, and scales the matmul's output once; its casts fitted 0.67x of rowwise's
# on an H200 (gpu_round3, llama3.1-8b's first 8 layers) and 0.54x on an H100 (gpu_round4, the same on real tokens)
FP8_CAST_SHARE = {"rowwise": 1.0, "tensorwise": 0.6}  # a price for each of parallel/fp8.py's RECIPES


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu_memory_gib: float
    peak_tflops: float
    intra_node_gbps: float  # GB/s per GPU
    inter_node_gbps: float
    pcie_gbps: float = 25.0  # host <-> GPU, per GPU
    cpu_adam_params_per_s: float = 2e8  # DeepSpeedCPUAdam throughput per GPU's share of the host
    # the optimizer step on the device, parameters per second per rank: fused AdamW reads a parameter, its gradient and
    # two moments and writes three (28 bytes in fp32), memory-bound: ~60% of an H100's 3.35 TB/s (calibrated)
    adam_params_per_s: float = 7e10
    mfu: float = 0.5  # fraction of peak the kernels reach (compute only; bubble and comm come on top)
    # --fp8: seconds per element of a linear's input or output per token that torchao's scaling and casting costs a
    # compiled step (activations forward, their gradients backward: 2·(in + out) a token), fitted to the GPU round's
    # H200 rows (gpt2-medium, llama3.2-1b, 3b: 4.9-8.4e-12 each; 6.0e-12 puts the three FP8/bf16 step ratios within
    # 13%, bench/gpu_round.md) and scaled to an H100's HBM (3.35 vs 4.8 TB/s)
    fp8_cast_s: float = 8.6e-12
    overlap: float = 0.5  # fraction of a compute window that communication running beside it can hide behind
    intra_node_latency_s: float = 0.0  # per ring step of a collective (plan/calibrate.py measures it; 0: not modeled)
    inter_node_latency_s: float = 0.0
    reserve_gib: float = 2.0  # CUDA context, NCCL buffers, allocator fragmentation
    host_memory_gib: float = 1024.0  # per node, for offloaded state
    # ranks that share one processor's throughput (a CPU host with more ranks than cores; calibrated): a rank idle in a
    # pipeline bubble leaves its share to the busy ones. 1: a device per rank
    ranks_per_processor: float = 1.0
    # (link "intra"/"inter", op, GB/s, latency per ring step) of the calls a calibration measured (plan/calibrate.OPS)
    op_links: tuple[tuple[str, str, float, float], ...] = ()

    def link(self, across_nodes: bool, op: str) -> tuple[float, float]:
        """(GB/s, seconds per ring step) of one `op` call: its own where measured (a reduce-scatter is priced as an
        all-gather, the same ring; a broadcast as a send), else the link's (an all-reduce's)."""
        where = "inter" if across_nodes else "intra"
        op = {"reduce_scatter": "all_gather", "broadcast": "send"}.get(op, op)
        for w, o, gbps, latency in self.op_links:
            if (w, o) == (where, op):
                return gbps, latency
        if across_nodes:
            return self.inter_node_gbps, self.inter_node_latency_s
        return self.intra_node_gbps, self.intra_node_latency_s

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def usable_bytes(self) -> float:
        return (self.gpu_memory_gib - self.reserve_gib) * 2**30
