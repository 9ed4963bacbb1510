"""Llama 3 (and the dense models that share its parts): the family as the registry sees it."""

from trainer3d.errors import ConfigError, LayoutError
from trainer3d.models.interface import ModelFamily
from trainer3d.models.llama.config import LlamaConfig
from trainer3d.models.llama.presets import PRESETS
from trainer3d.models.llama.hf import LlamaAdapter
from trainer3d.models.llama.model import Llama, init_value


def check(cfg: LlamaConfig, tp: int) -> None:
    """Query heads come in whole groups per kv head; tp must split the query heads and the kv heads alike (each rank
    holds whole kv groups: Megatron-LM's rule; replicating kv heads over a larger tp is not built), and SwiGLU's width."""
    if cfg.explicit_head_dim is None and cfg.n_embd % cfg.n_head:
        raise ConfigError(f"--n-embd {cfg.n_embd} must be a multiple of --n-head {cfg.n_head}.")
    if cfg.n_head % cfg.n_kv_heads:
        raise ConfigError(f"--n-head {cfg.n_head} must be a multiple of --n-kv-heads {cfg.n_kv_heads} (each key/value "
                          "head serves a whole group of query heads).")
    if cfg.n_head % tp:
        raise LayoutError(f"--tp {tp} must divide the model's {cfg.n_head} attention heads; pick a divisor of "
                          f"{cfg.n_head}.")
    if cfg.n_kv_heads % tp:
        raise LayoutError(f"--tp {tp} must divide the model's {cfg.n_kv_heads} key/value heads (grouped-query "
                          f"attention shards whole kv heads); pick a divisor of {cfg.n_kv_heads} and put the other GPUs on "
                          "--pp or data parallelism.")
    if cfg.moe is not None and not 1 <= cfg.moe.top_k <= cfg.moe.n_experts:
        raise ConfigError(f"--top-k {cfg.moe.top_k} must be between 1 and the model's {cfg.moe.n_experts} experts.")
    if any(not cfg.is_moe_layer(i) for i in range(cfg.n_layer)) and cfg.ffn_hidden % tp:  # (experts are not split)
        raise LayoutError(f"--tp {tp} must divide the model's MLP width of {cfg.ffn_hidden}; pick a divisor of it.")


FAMILY = ModelFamily(name="llama", config_cls=LlamaConfig, model_cls=Llama, presets=PRESETS, init_value=init_value,
                     check=check, hf=LlamaAdapter())

__all__ = ["FAMILY", "Llama", "LlamaConfig"]
