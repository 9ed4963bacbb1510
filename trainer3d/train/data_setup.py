"""A run's training data: one source (--data) or a weighted mixture of several (--data-mixture, data/mixture.py).
Each source is tokenized (or its shards opened) by one rank per node first (leader_first), so a node tokenizes a
corpus once; then every rank builds the same loader and validation passes over it."""

from __future__ import annotations

import dataclasses

from trainer3d.data import BatchLoader, DataConfig, TokenBlocks, build_rows, val_batches
from trainer3d.data.preference import PairRows, build_pairs
from trainer3d.data.mixture import MixtureBlocks, MixtureLoader, combine, mixture_validation, read_mixture
from trainer3d.distributed.leader import leader_first


def build_blocks(cfg, data_cfg: DataConfig, rank: int, local_rank: int) -> TokenBlocks | MixtureBlocks:
    """`data_cfg` is the run's data config; a mixture's sources each replace its source fields (data, data_config,
    text_field, format, and the options an entry gives) and keep the rest (the tokenizer, ...)."""
    if cfg.data_format == "preference":  # DPO's pairs, rendered in memory on every rank
        return build_pairs(data_cfg, cfg.seq_len, cfg.dpo_padding_free)
    if not cfg.data_mixture:
        return leader_first("tokenize the data into the cache", lambda: build_rows(data_cfg, cfg.seq_len),
                            rank, local_rank)
    sources = read_mixture(cfg.data_mixture, cfg.text_field)
    blocks = []
    for i, src in enumerate(sources):
        source_cfg = src.data_config_of(data_cfg)
        blocks.append(leader_first(f"tokenize mixture source {i} into the cache",
                                   lambda c=source_cfg: build_rows(c, cfg.seq_len), rank, local_rank))
    return combine(sources, blocks)


def build_val_pairs(cfg, data_cfg: DataConfig) -> PairRows | None:
    """--val-data's preference pairs (DPO's validation), rendered as the training pairs are; None without it."""
    if not cfg.val_data:
        return None
    return build_pairs(dataclasses.replace(data_cfg, data=cfg.val_data), cfg.seq_len, cfg.dpo_padding_free)


def make_loader(blocks, global_batch: int, dp_rank: int, dp_size: int, seed: int):
    """BatchLoader over one source's blocks, MixtureLoader over a mixture's."""
    kind = MixtureLoader if isinstance(blocks, MixtureBlocks) else BatchLoader
    return kind(blocks, global_batch, dp_rank, dp_size, seed)


def make_val_batches(blocks, global_batch: int, dp_rank: int, dp_size: int, max_batches: int | None):
    """The validation batches (one source), or each source's own (a mixture: data/mixture.MixtureValidation)."""
    if isinstance(blocks, MixtureBlocks):
        return mixture_validation(blocks, global_batch, dp_rank, dp_size, max_batches)
    return val_batches(blocks, global_batch, dp_rank, dp_size, max_batches)
