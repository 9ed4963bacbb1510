"""Entry point under every launcher, for every model family (launch/train_gpt2.py is the same script under the
name users' scripts already call):

    python launch/train.py                                        # one process, embedded default
    torchrun --nproc_per_node 8 launch/train.py --tp 2 --pp 2
    torchrun --nproc_per_node 8 launch/train.py --model llama3.1-8b --tp 8 --tokenizer meta-llama/Llama-3.1-8B
    deepspeed --num_gpus 8 launch/train.py --tp 2 --pp 2 --deepspeed_config ds_configs/zero1.json
    srun python launch/train.py ...                               # one task per GPU (see launch/slurm/)
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainer3d.train.loop import main  # noqa: E402

if __name__ == "__main__":
    code = main()
    # Everything is written (checkpoints, metrics, W&B finished) and the process group is gone: skip the interpreter's
    # teardown, where a native thread of DeepSpeed's ops can still be joinable when its owner is collected and abort
    # a clean exit (SIGABRT after a ZeRO-3 + CPU offload run saved on SIGTERM, seen once in CI).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
