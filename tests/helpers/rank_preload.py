"""Work every rank of a test world would otherwise repeat, done once in the forkserver its ranks fork from
(tests/helpers/distributed.py PRELOAD imports this module there): each rank inherits the results.

- DeepSpeed's Muon optimizer module, which the first ZeRO engine of a process imports (its optimizer check) and which
  runs torch.compile's decorators at import: ~2.5 s of CPU in each rank otherwise.
- trainer3d's DeepSpeed glue check (zero/glue.check_glue, remembered per process): parsing DeepSpeedEngine's source
  costs ~0.7 s of CPU, once in each rank otherwise.
- py-cpuinfo's get_cpu_info, a Python subprocess (~1 s under a world's load) that every trainer3d process asks once
  (zero/ops.ask_cpu_once): asked here, so that no rank asks.

(8 ranks on 2 cores: each second of CPU a rank saves is ~4 s of a world of 8's wall time.)
"""

from __future__ import annotations

import contextlib

import cpuinfo
import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401 - imported for the ranks

from trainer3d.zero.glue import check_glue
from trainer3d.zero.ops import ask_cpu_once

ask_cpu_once()
# on failure a rank runs it again and fails there, with the message (a forkserver would just die, and every world)
with contextlib.suppress(Exception):
    cpuinfo.get_cpu_info()
    check_glue()
