"""Assemble a deployment: loaded models + one block pool + the decoders each model serves.

This is the single place that decides sizes at start-up: how many KV blocks
the pool has (from a block count or a memory budget) and which decoders are
registered for which model. Everything it builds is handed to the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dualserve.models.loader import LoadedModel

from .ar import ARDecoder
from .block_manager import BlockPool
from .engine import Engine, EngineConfig
from .paged_attention import KVCache
from .runner import ModelRunner


@dataclass(frozen=True)
class PoolSpec:
    block_size: int = 16
    num_blocks: int | None = None      # explicit count wins
    memory_gb: float = 1.0             # else: this much memory for KV, split over all loaded models


@dataclass
class Deployment:
    engine: Engine
    models: dict[str, LoadedModel]
    runners: dict[str, ModelRunner] = field(default_factory=dict)


def blocks_for(models: list[LoadedModel], spec: PoolSpec, kv_dtype: torch.dtype) -> int:
    if spec.num_blocks:
        return spec.num_blocks
    per_block = sum(KVCache.bytes_per_block(m.config.num_layers, spec.block_size, m.config.num_kv_heads,
                                            m.config.head_dim, kv_dtype) for m in models)
    return max(16, int(spec.memory_gb * 2**30 // per_block))


def build_deployment(models: list[LoadedModel], engine_config: EngineConfig | None = None,
                     pool: PoolSpec = PoolSpec(), device: str = "cpu") -> Deployment:
    """One pool for all models; each AR-capable model gets the ``ar`` decoder."""
    kv_dtype = next(models[0].model.parameters()).dtype
    num_blocks = blocks_for(models, pool, kv_dtype)
    cfg = engine_config or EngineConfig()
    cfg = EngineConfig(num_blocks=num_blocks, block_size=pool.block_size, max_num_seqs=cfg.max_num_seqs,
                       max_batched_tokens=cfg.max_batched_tokens, max_waiting=cfg.max_waiting,
                       enable_prefix_caching=cfg.enable_prefix_caching)
    engine = Engine(cfg)
    dep = Deployment(engine=engine, models={m.name: m for m in models})
    for m in models:
        runner = ModelRunner(m.model, num_blocks, pool.block_size, device=device)
        dep.runners[m.name] = runner
        if not m.config.is_diffusion:
            engine.add_decoder(m.name, ARDecoder(runner, engine.pool), m.tokenizer)
    return dep
