"""launch/train.py under its original name, which users' scripts and launch/slurm/train_gpt2.sbatch call: every flag
and every model family (--model llama3.1-8b too) work the same."""

import os
import runpy

if __name__ == "__main__":
    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py"), run_name="__main__")
