"""DeepSeek-V3 (and Kimi K2, Moonlight): the family as the registry sees it."""

from trainer3d.errors import ConfigError, LayoutError
from trainer3d.models.deepseek_v3.config import DeepseekV3Config
from trainer3d.models.deepseek_v3.presets import PRESETS
from trainer3d.models.deepseek_v3.hf import DeepseekV3Adapter
from trainer3d.models.deepseek_v3.model import DeepseekV3
from trainer3d.models.interface import ModelFamily
from trainer3d.models.llama.model import init_value


def check(cfg: DeepseekV3Config, tp: int) -> None:
    """tp splits whole heads (and the dense blocks' SwiGLU width); the routing must be one transformers can run; MTP
    modules embed with the model's own embedding, which a tied head would share too (not built)."""
    if cfg.n_head % tp:
        raise LayoutError(f"--tp {tp} must divide the model's {cfg.n_head} attention heads; pick a divisor of "
                          f"{cfg.n_head}.")
    if any(not cfg.is_moe_layer(i) for i in range(cfg.n_layer)) and cfg.ffn_hidden % tp:  # (experts are not split)
        raise LayoutError(f"--tp {tp} must divide the model's MLP width of {cfg.ffn_hidden}; pick a divisor of it.")
    if cfg.mtp_layers and cfg.tie_embeddings:
        raise ConfigError("Multi-token prediction with a tied embedding and head is not built (DeepSeek-V3's are "
                          "untied); pass --mtp-loss-coef 0 to train without the MTP modules.")
    try:
        cfg.moe.check()
    except ValueError as e:
        raise ConfigError(f"The model's routing cannot work: {e}; change --n-experts or --top-k.") from None


FAMILY = ModelFamily(name="deepseek_v3", config_cls=DeepseekV3Config, model_cls=DeepseekV3, presets=PRESETS,
                     init_value=init_value, check=check, hf=DeepseekV3Adapter())

__all__ = ["FAMILY", "DeepseekV3", "DeepseekV3Config"]
