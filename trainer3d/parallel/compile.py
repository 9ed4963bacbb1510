"""--compile: torch.compile (inductor) on each transformer block, in place, after tensor parallelism and recomputation
and before the data-parallel engine (torchtitan's order), so pipeline splitting, TP, recomputation, DDP/ZeRO and
checkpoints see the same modules and parameter names as without it (nn.Module.compile() wraps no module).

Blocks, and the loss's per-chunk passes: the rest of a stage is an embedding lookup and the LM head, one matmul each;
the loss stays the hand-written chunked vocab-parallel autograd Function (its memory behaviour is its point), whose
chunk passes run as compiled graphs: the forward's statistics (max, exp, sums over the logits) and the backward's
scaling of the exponentials into the gradient (parallel/cross_entropy.py).
Every block runs the same code under the same guards, so all of a stage's blocks share one compiled graph (compile
time does not grow with depth).

What dynamo does with the parts of a block (torch 2.13):
  * TP layers: the custom autograd Functions are traced, forward and backward; their in-place `dist.all_reduce` on
    the tp group becomes a functional collective (`_c10d_functional.all_reduce` + `wait_tensor`) in the graph, run
    by gloo/NCCL as before. No graph break, no setting needed.
  * --recompute: dynamo cannot trace torch's checkpoint with our RNG-replaying context_fn (an object, not a function:
    "checkpoint not implemented for ... context_fn"), so the checkpoint stays eager and what it runs is compiled.
    full: the checkpoint is the block's forward; its function is compiled, so the forward and the recomputation run
    the same compiled code. selective: the block is compiled with the checkpointed attention core excluded
    (torch.compiler.disable: a graph break on each side of it; the core is one SDPA call, nothing to fuse).
  * dropout: inductor draws compiled dropout masks from its own RNG (seeded from the default generator), so masks
    differ from eager runs: compile-vs-eager parity holds for dropout 0 only. The default generator is seeded alike
    on tp peers, so replicated masks still agree there (tests/test_rng.py); the head-sharded attention dropout
    switches streams (fork_rng: dynamo falls back to eager for the attention core) and draws from the per-tp-rank
    stream exactly as without --compile. At dropout 0 the core switches nothing and is traced with the rest.
    Recomputation replays both (checkpoint restores the default generator, whose draws seed inductor's RNG).
  * DeepSpeed ZeRO-3's per-module hooks (gather a layer's parameters) are traced too: results stay right, but
    dynamo recompiles them per module type up to its limit and then runs them eagerly (a warning), so each layer is
    a graph break; ZeRO 0-2 and DDP add nothing inside a block.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
import torch.nn as nn

from trainer3d.errors import ConfigError
from trainer3d.parallel.recompute import Checkpointed
from trainer3d.private_api import require


def apply_compile(stage: nn.Module, backend: str | None) -> nn.Module:
    """Compile this stage's blocks in place (their parameters stay where they are) with torch.compile's `backend`
    (None: not at all)."""
    if not backend:
        return stage
    plan = stage.parallel_plan()
    for block in stage.blocks.values():
        if isinstance(block.forward, Checkpointed):  # --recompute full
            block.forward.fn = torch.compile(block.forward.fn, backend=backend)
            continue
        attn = plan.mixer(block)
        if isinstance(attn.core, Checkpointed):  # --recompute selective
            attn.core = torch.compiler.disable(attn.core)
        block.compile(backend=backend)
    return stage


def check_compiler(device_type: str) -> None:
    """--compile needs what inductor builds kernels with: triton on CUDA; on CPU the C++ compiler inductor itself
    looks for (torch._inductor.config.cpp.cxx: $CXX, else g++) and Python's headers; and dynamo must support this
    Python. One sentence naming the fix."""
    require("parallel/compile.py", ConfigError)
    from torch._dynamo.eval_frame import check_if_dynamo_supported

    try:
        check_if_dynamo_supported()
    except RuntimeError as e:
        raise ConfigError(
            f"--compile cannot run here ({e}); use a Python torch.compile supports, or drop --compile."
        ) from None
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise ConfigError(
                "--compile needs Triton on CUDA, which is not importable; pip install triton, or drop --compile."
            )
        return
    from torch._inductor import config as inductor_config
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception:  # noqa: BLE001 - inductor's InvalidCxxCompiler, or anything else that stops it finding one
        tried = [c for c in inductor_config.cpp.cxx if c]
        raise ConfigError(
            f"--compile needs a C++ compiler for inductor's CPU kernels and none works (tried {', '.join(tried)}); "
            "install g++ (e.g. apt-get install g++) or point CXX at one, or drop --compile."
        ) from None
    include = Path(sysconfig.get_path("include"))
    if not (include / "Python.h").exists():
        raise ConfigError(
            f"--compile needs Python's C headers for inductor's CPU kernels and {include / 'Python.h'} is missing; "
            "install them (e.g. apt-get install python3-dev), or drop --compile."
        )
