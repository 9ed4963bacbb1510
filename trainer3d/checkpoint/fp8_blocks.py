"""Hugging Face weights published in FP8 with block scales (DeepSeek-V3/V3.1/V3.2, Kimi K2: `quantization_config`
{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}), read as the real values they stand for:
each quantized weight W (float8_e4m3fn) has a companion `<name>_scale_inv` S of ceil(rows/128) × ceil(cols/128), and
W[i, j] stands for W[i, j] · S[i // 128, j // 128], transformers' and DeepSeek's own dequantization. A read of any
rows and columns of W (a tp rank's shard) reads those bytes of W and the scale blocks that cover them: the load streams
tensor by tensor and slice by slice, and no dequantized copy of the model is written or held.
Written here because safetensors and transformers offer the rule only for whole tensors on a GPU (its finegrained
FP8 integration, which needs CUDA or its Triton kernel)."""

from __future__ import annotations

import math

import torch

SCALE_SUFFIX = "_scale_inv"


def block_size(raw_config: dict) -> tuple[int, int] | None:
    """The (rows, cols) of a config's FP8 weight blocks, or None where its weights are not block-scaled FP8."""
    q = raw_config.get("quantization_config") or {}
    block = q.get("weight_block_size")
    if q.get("quant_method") != "fp8" or q.get("fmt", "e4m3") != "e4m3" or not isinstance(block, (list, tuple)):
        return None
    return (int(block[0]), int(block[1])) if len(block) == 2 and all(int(b) > 0 for b in block) else None


def scale_shape(weight_shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(weight_shape[0] / block[0]), math.ceil(weight_shape[1] / block[1])


def dequantize(weight: torch.Tensor, read_scales, block: tuple[int, int], rows: slice, cols: slice) -> torch.Tensor:
    """fp32 values of `weight` = rows × cols of a quantized tensor (read already); `read_scales(r, c)` reads the scale
    blocks of rows r and columns c (slices of the scale tensor)."""
    (r0, r1), (c0, c1), (br, bc) = (rows.start, rows.stop), (cols.start, cols.stop), block
    sr, sc = slice(r0 // br, -(-r1 // br)), slice(c0 // bc, -(-c1 // bc))
    scales = read_scales(sr, sc).float().repeat_interleave(br, 0).repeat_interleave(bc, 1)
    scales = scales[r0 - sr.start * br: r1 - sr.start * br, c0 - sc.start * bc: c1 - sc.start * bc]
    return weight.float() * scales


class BlockScales:
    """A directory's block scales, taken out of its tensor index (`index`: HF name -> (file, key); the scales'
    entries are removed from it): which weights are quantized, and their values as read. `read(file, key, slices)`
    reads those bytes of a stored tensor; `shape(file, key)` its shape."""

    def __init__(self, block: tuple[int, int] | None, index: dict, read, shape):
        self.block, self._read, self._shape = block, read, shape
        names = [n for n in index if n.endswith(SCALE_SUFFIX)] if block is not None else []
        self.where = {name[: -len(SCALE_SUFFIX)]: index.pop(name) for name in names}

    def __contains__(self, hf_name: str) -> bool:
        return hf_name in self.where

    def values(self, hf_name: str, weight: torch.Tensor, rows: slice, cols: slice) -> torch.Tensor:
        """The fp32 values of `weight`, the rows × cols of the quantized `hf_name` that were read."""
        file, key = self.where[hf_name]
        return dequantize(weight, lambda r, c: self._read(file, key, (r, c)), self.block, rows, cols)

    def check(self, shapes: dict, source) -> None:
        """Each scale tensor belongs to a weight of the config (`shapes`: HF name -> shape), with its blocks' shape."""
        for hf_name, (file, key) in self.where.items():
            got = tuple(self._shape(file, key))
            weight = shapes.get(hf_name)
            if weight is None or len(weight) != 2 or got != scale_shape(weight, self.block):
                raise ValueError(f"{source}: block scales {key!r} of shape {got} fit no weight of the config (FP8 "
                                 f"blocks of {self.block[0]}x{self.block[1]})")
