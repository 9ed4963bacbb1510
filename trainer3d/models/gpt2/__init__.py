"""GPT-2 (and the GPT-3 shapes): the family as the registry sees it."""

from trainer3d.errors import ConfigError, LayoutError
from trainer3d.models.gpt2.config import GPTConfig
from trainer3d.models.gpt2.presets import PRESETS
from trainer3d.models.gpt2.hf import GPT2Adapter
from trainer3d.models.gpt2.model import GPT, init_value
from trainer3d.models.interface import ModelFamily


def check(cfg: GPTConfig, tp: int) -> None:
    if cfg.n_embd % cfg.n_head:
        raise ConfigError(f"--n-embd {cfg.n_embd} must be a multiple of --n-head {cfg.n_head}.")
    if cfg.n_head % tp:
        raise LayoutError(f"--tp {tp} must divide the model's {cfg.n_head} attention heads; pick a divisor of "
                          f"{cfg.n_head}.")


FAMILY = ModelFamily(name="gpt2", config_cls=GPTConfig, model_cls=GPT, presets=PRESETS, init_value=init_value,
                     check=check, hf=GPT2Adapter())

__all__ = ["FAMILY", "GPT", "GPTConfig"]
