"""Mixtral: the family as the registry sees it (the model is Llama's, every block's MLP a mixture of experts)."""

from trainer3d.models import llama
from trainer3d.models.interface import ModelFamily
from trainer3d.models.llama.model import Llama, init_value
from trainer3d.models.mixtral.config import MixtralConfig
from trainer3d.models.mixtral.presets import PRESETS
from trainer3d.models.mixtral.hf import MixtralAdapter

FAMILY = ModelFamily(name="mixtral", config_cls=MixtralConfig, model_cls=Llama, presets=PRESETS,
                     init_value=init_value, check=llama.check, hf=MixtralAdapter())

__all__ = ["FAMILY", "MixtralConfig"]
