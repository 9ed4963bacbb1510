"""trainer3d as the training side of another program: `Engine` (engine.py) and what a call trains on (batch.py)."""

from trainer3d.engine.batch import AGGREGATIONS, token_weights
from trainer3d.engine.engine import Engine

__all__ = ["AGGREGATIONS", "Engine", "token_weights"]
