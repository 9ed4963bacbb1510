"""FP8 training (--fp8 tensorwise|rowwise): torchao's float8 matmul inside trainer3d's tensor-parallel layers.

torchao's `convert_to_float8_training` swaps nn.Linear modules; trainer3d's block linears are its own column- and
row-parallel layers (at tp=1 too), so they call the autograd matmul torchao's Float8Linear calls
(`matmul_with_hp_or_float8_args`: input, weight and output gradient cast to float8 with dynamic scales, tensorwise
or rowwise; the scaled matmul in torch._scaled_mm). Nothing numeric is written here: only which layers run in FP8.

Which: the attention and MLP linears of every block but the first and the last (kept in bf16 for stability, as
Megatron's --first-last-layers-bf16 and Transformer Engine's recipes do), where this rank's shard has both dims a
multiple of 16 (torch._scaled_mm's rule). Never FP8: the embedding, the LM head, routers, the experts' grouped GEMMs
(torchao's FP8 grouped GEMM is a CUDA-only prototype) and multi-token prediction's blocks. The scales are dynamic
(computed from each tensor when cast), so there is no scaling state to checkpoint: a resume is exact as without FP8.
"""

from __future__ import annotations

import dataclasses
import os
from functools import lru_cache

import torch
import torch.nn as nn

from trainer3d.errors import ConfigError
from trainer3d.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, linear_at

RECIPES = ("tensorwise", "rowwise")
# Tests set this: torchao's emulation (float8 casts, the matmul in high precision), which runs on a CPU.
EMULATE_ENV = "TRAINER3D_FP8_EMULATE"
MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first with FP8 tensor cores


def emulated() -> bool:
    return os.environ.get(EMULATE_ENV) == "1"


def check_fp8(recipe: str, precision: str, device_type: str) -> None:
    """--fp8's one-sentence refusals, before any process group."""
    if recipe not in RECIPES:
        raise ConfigError(f"--fp8 must be one of {', '.join(RECIPES)} (got {recipe!r}).")
    if precision == "fp16":
        raise ConfigError("--fp8 runs its scaled matmuls from bf16 or fp32 activations; use --precision bf16.")
    try:
        _torchao_float8()
    except ImportError:
        raise ConfigError("--fp8 needs torchao; install it with `pip install torchao`.") from None
    if emulated():
        return
    if device_type != "cuda":
        raise ConfigError("--fp8 needs an NVIDIA GPU with FP8 tensor cores (compute capability 8.9+: L40S, H100, "
                          "H200, B200); this machine has no GPU.")
    cap = torch.cuda.get_device_capability()
    if cap < MIN_CAPABILITY:
        raise ConfigError(f"--fp8 needs an NVIDIA GPU with FP8 tensor cores (compute capability 8.9+); "
                          f"{torch.cuda.get_device_name()} is {cap[0]}.{cap[1]}.")


# What importing torchao.float8 logs and no user acts on: torchao's notice that its CUDA kernels do not load on a
# CPU-only torch, and torch 2.13's deprecation of the register_constant call torchao 0.18 makes on an Enum
QUIET_ON_IMPORT = ("torchao", "torch.utils._pytree")


def _torchao_float8():
    """Import torchao.float8 with QUIET_ON_IMPORT's loggers at ERROR, so that --fp8's refusals stay one sentence."""
    import logging

    logs = [logging.getLogger(name) for name in QUIET_ON_IMPORT]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)
    return float8


class FP8Matmul:
    """x @ weight.T through torchao's float8 training matmul for one recipe (shared by every FP8 layer)."""

    def __init__(self, recipe: str, emulate: bool):
        _torchao_float8()
        from torchao.float8 import Float8LinearConfig
        from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

        c = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
        mm = lambda g: ScaledMMConfig(emulate, g.use_fast_accum, False, c.pad_inner_dim)  # noqa: E731 (Float8Linear's)
        self.config, self.recipe = c, recipe
        self.mm_config = LinearMMConfig(mm(c.gemm_config_output), mm(c.gemm_config_grad_input),
                                        mm(c.gemm_config_grad_weight))

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

        return matmul_with_hp_or_float8_args.apply(x, weight.t(), self.mm_config, self.config)


def eligible(block_index: int, n_layer: int, weight: torch.Tensor) -> bool:
    """THE rule of which linears run in FP8: not in the first or last block, both dims multiples of 16."""
    return block_index not in (0, n_layer - 1) and all(n % 16 == 0 for n in weight.shape)


def apply_fp8(stage: nn.Module, recipe: str | None, n_layer: int) -> list[str]:
    """Give the eligible tensor-parallel linears of `stage`'s blocks (this rank's shards) an FP8Matmul (their `fp8`
    attribute); the names of those that got one."""
    if recipe is None:
        return []
    matmul = FP8Matmul(recipe, emulate=emulated())
    chosen = []
    for index, block in stage.blocks.items():
        for name, module in block.named_modules():
            tp_linear = isinstance(module, (ColumnParallelLinear, RowParallelLinear))
            if tp_linear and eligible(int(index), n_layer, module.weight):
                module.fp8 = matmul
                chosen.append(f"{stage.BLOCKS}.{index}.{name}")
    return chosen


def describe(recipe: str, chosen: list[str], total_blocks: int, compiled: bool) -> str:
    """One line for the banner: how many linears run in FP8 and in which blocks; a warning without --compile, where
    torchao's casts and scales run as separate kernels (0.35-0.53x of bf16 on an H200: bench/gpu_round.md)."""
    blocks = sorted({int(n.split(".")[1]) for n in chosen})
    span = f"blocks {blocks[0]}-{blocks[-1]}" if blocks else "no block"
    slow = "" if compiled else "; without --compile FP8's casts run unfused, slower than bf16: add --compile"
    return (f"fp8={recipe}: {len(chosen)} linears in {span} of 0-{total_blocks - 1} (bf16: the first and last block, "
            f"embedding, head, routers, experts, MTP; dims not multiples of 16){slow}")


@lru_cache(maxsize=None)
def fp8_linears(mcfg) -> tuple[int, int]:
    """(weights, Σ in + out features) of the linears --fp8 runs in FP8 at tp=1, whole model: the planner's FP8 FLOPs
    (6 per weight and token) and its casts (each token's activations and their gradients, per linear); read off the
    family's plain model on the meta device, as apply_fp8 chooses."""
    from trainer3d.models import build_model

    with torch.device("meta"):
        model = build_model(mcfg)
    linears = [(int(index), linear_at(block, path)) for index, block in model.blocks.items()
               for path in model.parallel_plan().linears]
    chosen = [m for index, m in linears if m is not None and eligible(index, mcfg.n_layer, m.weight)]
    return sum(m.weight.numel() for m in chosen), sum(m.in_features + m.out_features for m in chosen)
