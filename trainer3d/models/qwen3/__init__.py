"""Qwen3, dense and MoE: the family as the registry sees it (the model is Llama's, with q/k norms and MoE blocks)."""

from trainer3d.errors import ConfigError
from trainer3d.models import llama
from trainer3d.models.interface import ModelFamily
from trainer3d.models.llama.model import Llama, init_value
from trainer3d.models.qwen3.config import Qwen3Config
from trainer3d.models.qwen3.presets import PRESETS
from trainer3d.models.qwen3.hf import Qwen3Adapter


def check(cfg: Qwen3Config, tp: int) -> None:
    """Llama's rules for the attention under tp; an MoE's top-k within its experts."""
    llama.check(cfg, tp)
    if cfg.n_experts and not 1 <= cfg.top_k <= cfg.n_experts:
        raise ConfigError(f"The model routes each token to {cfg.top_k} of {cfg.n_experts} experts; top-k must be "
                          "between 1 and the number of experts.")


FAMILY = ModelFamily(name="qwen3", config_cls=Qwen3Config, model_cls=Llama, presets=PRESETS, init_value=init_value,
                     check=check, hf=Qwen3Adapter())

__all__ = ["FAMILY", "Qwen3Config"]
