"""`python -m trainer3d.prepare SOURCE OUT`: tokenize a corpus into token shards once (trainer3d/data/prepare.py)."""

import os
import sys

# datasets imports torch when it can (2 s per run); tokenizing needs none of it
os.environ.setdefault("USE_TORCH", "0")

from trainer3d.data.prepare import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
