"""Entry point under every launcher:

    python launch/train_gpt2.py                                   # one process, embedded default
    torchrun --nproc_per_node 8 launch/train_gpt2.py --tp 2 --pp 2
    deepspeed --num_gpus 8 launch/train_gpt2.py --tp 2 --pp 2 --deepspeed_config ds_configs/zero1.json
    srun python launch/train_gpt2.py ...                          # one task per GPU (see launch/slurm/)
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainer3d.train.loop import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
