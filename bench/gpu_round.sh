#!/usr/bin/env bash
# The GPU round: everything one lent GPU session measures, unattended, in at most ~8 minutes on one H100/H200.
# What each part runs and how long it is estimated to take: bench/gpu_round.py's docstring (estimates until a round
# has run; bench/gpu_round.md has the measured ones). Results are written as they come, under $OUT
# (the device tool's output folder; default bench/results/gpu_round): summary.md (one row per part), round.log (every
# command's output), env.txt (nvidia-smi, torch, CUDA, NCCL, driver, DeepSpeed, torchao), gpu_mfu.json, mfu.txt,
# kernels.txt (the top kernels of each trainer row), phases.txt (a gpt2 step: host time by phase, its syncs).
#
#   bash ../shared/tools/device_wheels.sh                    # here, once: .whl/ with what the GPU image lacks
#   device run, carry [".whl"]:  bash bench/gpu_round.sh      # there; installs .whl/ first
#   GPU_ROUND_DRY=1 bash bench/gpu_round.sh                   # every part on CPU at tiny sizes (tests/test_gpu_round.py)
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${GPU_ROUND_DRY:-0}" != 1 ] && [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || echo "gpu_round: installing .whl/ failed; going on with the image's packages"
fi
export PYTHONUNBUFFERED=1
exec python3 bench/gpu_round.py "$@"
