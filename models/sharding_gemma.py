"""Tensor parallelism for DiffusionGemma (``diffusion_gemma.py``), applied from outside the model.

The splits of the transformer core (``sharding_core.py``), for Gemma 4's layer:

  * attention: this rank's query heads and the KV heads they read, then ``o_proj`` row parallel
    over the same heads. A layer with at least as many KV heads as ranks splits by KV head (the
    query heads of each follow). A layer with fewer (a full layer's one or two) gives each rank an
    equal slice of the query heads and replicates the one KV head they share, as vLLM does; every
    rank then stores that head's keys and values;
  * the dense MLP and the self-conditioning block: gate and up column parallel, down row parallel;
  * the experts: every expert's intermediate rows split alike (gate/up rows, down columns). The
    router stays whole on every rank: it is small and reads the whole residual, so every rank
    routes each token to the same experts;
  * the tied embedding stays whole on every rank. It is read three ways: the lookup, the
    self-conditioning product of the previous step's probabilities with every embedding row, and
    the tied head. Split over the vocabulary, the self-conditioning product would be a sum of
    per-rank partial products, which is not exact.

A row-parallel layer combines across ranks as ``Shard.reduction`` says: "exact" gathers the input
and the output slices (``GatheredLinear``: every element computed as on one rank), "sum" adds the
partial products with one all-reduce (Megatron's). DiffusionGemma shares no linear layer with
another model, so the sum hangs on the layer itself.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from .diffusion_gemma import Attention, DiffusionGemma, DiffusionGemmaConfig, Experts, grouped_linear
from .sharding_core import GatheredLinear, Shard, gather_last, span, split_sizes, take_cols, take_rows


class SummedLinear(nn.Module):
    """A row-parallel layer, Megatron's way: this rank's input columns, partial outputs summed."""

    def __init__(self, local: nn.Module, group: dist.ProcessGroup | None):
        super().__init__()
        self.local, self.group = local, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local(x)
        dist.all_reduce(y, group=self.group)
        return y


class ShardedExperts(Experts):
    """This rank's slice of every expert's intermediate rows; ``down`` combines across ranks."""

    def __init__(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, in_sizes: Sequence[int],
                 out_sizes: Sequence[int] | None, group: dist.ProcessGroup | None):
        """``out_sizes`` None: "sum" (``down_proj`` holds this rank's input columns); else "exact"
        (it holds this rank's output rows, over the whole intermediate width)."""
        nn.Module.__init__(self)
        self.num_experts = gate_up_proj.shape[0]
        self.gate_up_proj = nn.Parameter(gate_up_proj.contiguous(), requires_grad=False)
        self.down_proj = nn.Parameter(down_proj.contiguous(), requires_grad=False)
        self.in_sizes, self.out_sizes, self.group = list(in_sizes), out_sizes, group

    def down(self, act: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        if self.out_sizes is None:
            y = grouped_linear(act, self.down_proj, ends)
            dist.all_reduce(y, group=self.group)
            return y
        y = grouped_linear(gather_last(act, self.in_sizes, self.group), self.down_proj, ends)
        return gather_last(y, self.out_sizes, self.group)


def cannot_split(config: DiffusionGemmaConfig, world: int) -> str | None:
    """Why ``world`` ranks cannot share this model, or None: each rank takes whole key/value heads,
    or an equal share of one head's query heads (``head_split``), and a slice of every MLP."""
    for kv in sorted(set(config.kv_heads)):
        if not heads_split(config.num_heads, kv, world):
            return f"its {config.num_heads} query heads over {kv} key/value heads do not split over {world} ranks"
    for size, what in ((config.intermediate_size, "its MLP"), (config.moe_intermediate_size, "its experts' MLP")):
        if size < world:
            return f"{what} is {size} wide"
    return None


def heads_split(num_heads: int, kv_heads: int, world: int) -> bool:
    """Whether one attention layer shares out over ``world`` ranks (``head_split``): whole KV heads
    each, or, with fewer KV heads than ranks, an equal share of one KV head's query heads."""
    return kv_heads >= world or (world % kv_heads == 0 and num_heads % world == 0)


def head_split(num_heads: int, kv_heads: int, world: int, rank: int) -> tuple[int, int, int, int]:
    """(first query head, end, first KV head, end) of ``rank``'s share of one attention layer."""
    if kv_heads >= world:
        kv_lo, kv_hi = span(split_sizes(kv_heads, world), rank)
        group = num_heads // kv_heads
        return kv_lo * group, kv_hi * group, kv_lo, kv_hi
    if not heads_split(num_heads, kv_heads, world):
        raise ValueError(f"{num_heads} query heads over {kv_heads} KV heads cannot be split over {world} ranks")
    per_rank, ranks_per_kv = num_heads // world, world // kv_heads
    kv = rank // ranks_per_kv
    return rank * per_rank, (rank + 1) * per_rank, kv, kv + 1


class GemmaSharder:
    """Shards a DiffusionGemma in place for one rank (see the module docstring)."""

    def __init__(self, shard: Shard):
        self.shard = shard

    def row_parallel(self, layer: nn.Module, in_sizes: Sequence[int]) -> nn.Module:
        rank, world, group = self.shard.rank, self.shard.world, self.shard.group
        if self.shard.reduction == "sum":
            return SummedLinear(take_cols(layer, *span(in_sizes, rank), keep_bias=rank == 0), group)
        out_sizes = split_sizes(layer.out_features, world)
        return GatheredLinear(take_rows(layer, torch.arange(*span(out_sizes, rank))), in_sizes, out_sizes, group)

    def attention(self, attn: Attention) -> None:
        world, d = self.shard.world, attn.head_dim
        splits = [head_split(attn.num_heads, attn.kv_heads, world, r) for r in range(world)]
        q_lo, q_hi, kv_lo, kv_hi = splits[self.shard.rank]
        kv_rows = torch.arange(kv_lo * d, kv_hi * d)
        attn.q_proj = take_rows(attn.q_proj, torch.arange(q_lo * d, q_hi * d))
        attn.k_proj = take_rows(attn.k_proj, kv_rows)
        if attn.v_proj is not None:
            attn.v_proj = take_rows(attn.v_proj, kv_rows)
        attn.o_proj = self.row_parallel(attn.o_proj, [(hi - lo) * d for lo, hi, _, _ in splits])
        attn.num_heads, attn.kv_heads = q_hi - q_lo, kv_hi - kv_lo

    def mlp(self, block: nn.Module, intermediate: int) -> None:
        """A gate/up/down GELU block (the dense MLP, the self-conditioning block)."""
        sizes = split_sizes(intermediate, self.shard.world)
        rows = torch.arange(*span(sizes, self.shard.rank))
        block.gate_proj = take_rows(block.gate_proj, rows)
        block.up_proj = take_rows(block.up_proj, rows)
        block.down_proj = self.row_parallel(block.down_proj, sizes)

    def experts(self, experts: Experts, intermediate: int) -> ShardedExperts:
        rank, world, group = self.shard.rank, self.shard.world, self.shard.group
        sizes = split_sizes(intermediate, world)
        lo, hi = span(sizes, rank)
        gate_up = experts.gate_up_proj[:, torch.cat([torch.arange(lo, hi), intermediate + torch.arange(lo, hi)])]
        if self.shard.reduction == "sum":
            return ShardedExperts(gate_up, experts.down_proj[:, :, lo:hi], sizes, None, group)
        out_sizes = split_sizes(experts.down_proj.shape[1], world)
        o_lo, o_hi = span(out_sizes, rank)
        return ShardedExperts(gate_up, experts.down_proj[:, o_lo:o_hi], sizes, out_sizes, group)

    def __call__(self, model: DiffusionGemma) -> DiffusionGemma:
        cfg = model.config
        for layer in model.layers:
            self.attention(layer.self_attn)
            self.mlp(layer.mlp, cfg.intermediate_size)
            layer.experts = self.experts(layer.experts, cfg.moe_intermediate_size)
        self.mlp(model.self_conditioning, cfg.intermediate_size)
        # KV caches are sized from the config: this rank stores the KV heads its query heads read.
        model.config = dataclasses.replace(cfg, num_heads=model.layers[0].self_attn.num_heads,
                                           kv_heads=tuple(layer.self_attn.kv_heads for layer in model.layers))
        return model


def sharded_modules(model: DiffusionGemma) -> list[nn.Module]:
    """The modules tensor parallelism splits: attention, MLP, experts, self-conditioning."""
    mods: list[nn.Module] = [model.self_conditioning.gate_proj, model.self_conditioning.up_proj,
                             model.self_conditioning.down_proj]
    for layer in model.layers:
        a = layer.self_attn
        mods += [a.q_proj, a.k_proj, a.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj,
                 layer.experts] + ([a.v_proj] if a.v_proj is not None else [])
    return mods
