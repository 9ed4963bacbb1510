"""Qwen3.5, dense and MoE: the family as the registry sees it (a hybrid of Gated DeltaNet and gated full attention)."""

from trainer3d.errors import ConfigError, LayoutError
from trainer3d.models import llama
from trainer3d.models.interface import ModelFamily
from trainer3d.models.qwen3_5.config import Qwen35Config
from trainer3d.models.qwen3_5.hf import Qwen35Adapter
from trainer3d.models.qwen3_5.model import Qwen35, init_value
from trainer3d.models.qwen3_5.presets import PRESETS


def check(cfg: Qwen35Config, tp: int) -> None:
    """Llama's rules for the full attention under tp; the linear attention's key heads (each serving whole groups of
    value heads) split over tp alike."""
    llama.check(cfg, tp)
    if cfg.linear_value_heads % cfg.linear_key_heads:
        raise ConfigError(f"The model's {cfg.linear_value_heads} linear-attention value heads must be a multiple of "
                          f"its {cfg.linear_key_heads} key heads (each key head serves a whole group).")
    if cfg.linear_key_heads % tp:
        raise LayoutError(f"--tp {tp} must divide the model's {cfg.linear_key_heads} linear-attention key heads "
                          f"(a rank holds whole key heads and the value heads they serve); pick a divisor of "
                          f"{cfg.linear_key_heads}.")


def check_cp(cfg: Qwen35Config, tp: int, cp: int) -> None:
    """Context parallelism gives each cp rank the whole sequence of 1/cp of a tp rank's linear-attention heads."""
    if cfg.linear_key_heads % (tp * cp):
        raise LayoutError(f"--cp {cp} with --tp {tp} must divide the model's {cfg.linear_key_heads} linear-attention "
                          f"key heads (each cp rank runs the recurrence of whole key heads over the whole sequence); "
                          f"pick tp × cp dividing {cfg.linear_key_heads}.")


FAMILY = ModelFamily(name="qwen3_5", config_cls=Qwen35Config, model_cls=Qwen35, presets=PRESETS,
                     init_value=init_value, check=check, hf=Qwen35Adapter(), check_cp=check_cp)

__all__ = ["FAMILY", "Qwen35", "Qwen35Config"]
