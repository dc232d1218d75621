"""Tensor parallelism for the transformer core, applied from outside the model: its sharder and the
primitives every family's sharder shares (slicing layers, gathered and vocabulary-parallel layers).

As in gpt-fast's ``tp.py`` (and Megatron-LM, Shoeybi et al., 2019, section 3), each rank keeps a
slice of every large matrix and the model file never mentions ranks:

  * attention: q/k/v rows of this rank's KV heads (and the query heads that share them), then
    ``o_proj`` row-parallel over the same heads;
  * MLP: ``gate_up_proj`` rows (this rank's part of gate and of up), then ``down_proj`` row-parallel;
  * embedding: a slice of the vocabulary; rows outside it are zero and an all-reduce fills them
    in (adding zeros is exact, so the embedding equals the unsharded one bit for bit);
  * output head: a slice of the vocabulary, gathered into full logits.

A row-parallel layer is combined across ranks one of two ways (``Reduction``):

  * "sum", Megatron's: each rank multiplies its input columns and one all-reduce per block half
    adds the partial products. The all-reduce adds them in another order than one GEMM does (and
    the int4 kernel rounds each partial to bf16), so hidden states differ from one rank in the last
    bits, and greedy output can differ at near-ties (measured in the README);
  * "exact": each rank gathers the whole input and computes its slice of the output rows with the
    full inner sum, and the slices are gathered (``GatheredLinear``, two all-gathers per half).
    Every element is computed as on one rank, so greedy output is the one rank's.

The "sum" reductions hang on the attention and MLP modules (forward hooks), never on the linear
layers, because a diffusion twin shares the AR model's linear layers and wraps some of them in a
LoRA: the adapter's partial product must join the base's before the sum. Shared modules are
sharded once and every model that references them gets the same sharded object (``CoreSharder.memo``).

Heads split by KV head, as evenly as they go: SmolLM2-135M's 3 KV heads on 2 ranks give 2 and 1
(6 and 3 query heads). The MLP's intermediate size splits in whole int4 groups of 32.

Quantized layers shard without re-quantizing: int8 rows and columns are sliced with their
per-channel scales; an int4 layer's integers are read back exactly (its kernel with unit scales,
``int4_values``), sliced with their groups' scales and zeros, and packed again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .adapter import LoRA, MaskedEmbedding
from .config import ModelConfig
from .quant import GROUP, Dot8Linear, Int4Linear, Int8Linear, QuantEmbedding, W8A8Linear
from .tied_embedding import HeadRowsEmbedding
from .transformer import Attention, DecoderLayer, SwiGLU, Transformer


# How a block half's row-parallel layer is combined across ranks:
#   "sum"   Megatron's: each rank multiplies its input columns, one all-reduce adds the partials;
#   "exact" each rank gathers the whole input, computes its slice of the output rows with the full
#           inner sum, and the slices are gathered: every output element is computed as at TP=1, so
#           greedy output is identical (two all-gathers per half instead of one all-reduce).
Reduction = Literal["sum", "exact"]


@dataclass(frozen=True)
class Shard:
    """This process's place in a tensor-parallel group."""

    rank: int
    world: int
    group: dist.ProcessGroup | None = None  # None: the default group
    reduction: Reduction = "sum"


def split_sizes(n: int, world: int, unit: int = 1) -> list[int]:
    """``n`` split over ``world`` ranks in whole units, earlier ranks taking the remainder."""
    if n % unit:
        raise ValueError(f"{n} is not a multiple of {unit}")
    units, rest = divmod(n // unit, world)
    sizes = [(units + (r < rest)) * unit for r in range(world)]
    if 0 in sizes:
        raise ValueError(f"{n} cannot be split over {world} ranks in units of {unit}")
    return sizes


def most_ranks(num_kv_heads: int, intermediate_size: int, vocab_size: int) -> tuple[int, str]:
    """The most ranks a model of these sizes shards over, and the size that binds: every rank needs
    a key/value head (whole query groups stay together), a slice of the MLP and of the vocabulary."""
    return min((num_kv_heads, f"it has {num_kv_heads} key/value heads"),
               (intermediate_size, f"its MLP is {intermediate_size} wide"),
               (vocab_size, f"its vocabulary has {vocab_size} tokens"))


def span(sizes: Sequence[int], rank: int) -> tuple[int, int]:
    lo = sum(sizes[:rank])
    return lo, lo + sizes[rank]


# ---- slicing one layer ---------------------------------------------------------------


def int4_values(layer: Int4Linear) -> torch.Tensor:
    """The (out, in) integers 0..15 of an int4 layer, exactly: its own kernel with scale 1 and
    zero 0 (``mid`` 8) returns ``q`` for an identity input, and small integers are exact in bf16."""
    return layer.values()


def int4_from(q: torch.Tensor, scales_and_zeros: torch.Tensor, bias: torch.Tensor | None,
              group_size: int) -> Int4Linear:
    """An int4 layer from integers (out, in) and the kernel's (in // group, out, 2) scales and mids."""
    scales = scales_and_zeros[..., 0].t().float()
    zeros = scales_and_zeros[..., 1].t().float() - 8 * scales
    layer = Int4Linear(q, scales, zeros, bias, group_size)
    layer.scales_and_zeros = scales_and_zeros.contiguous()  # the exact bf16 values, not a round trip
    return layer


def dot8_parts(layer: Dot8Linear, rows: torch.Tensor | slice = slice(None), lo: int = 0,
               hi: int | None = None) -> dict[str, torch.Tensor]:
    """Output rows ``rows`` and input columns lo..hi (whole groups of 32) of a dot8 layer in its exact
    portable form: integers, fp16 scales and minimums, multipliers."""
    hi = layer.in_features if hi is None else hi
    groups = slice(lo // GROUP, hi // GROUP)
    return {k: v[rows][:, lo:hi] if k == "qweight" else v[rows][:, groups] for k, v in layer.portable().items()}


def float_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(weight.contiguous().clone(), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.contiguous().clone(), requires_grad=False)
    return layer


def take_rows(layer: nn.Module, rows: torch.Tensor) -> nn.Module:
    """The output rows ``rows`` of a linear layer (column parallel)."""
    if isinstance(layer, nn.Linear):
        return float_linear(layer.weight[rows], None if layer.bias is None else layer.bias[rows])
    bias = None if layer.bias is None else layer.bias[rows]
    if isinstance(layer, W8A8Linear):
        return W8A8Linear(layer.qweight[rows], layer.scales[rows], bias, layer.digits)
    if isinstance(layer, Int8Linear):
        return Int8Linear(layer.qweight[rows], layer.scales[rows], bias)
    if isinstance(layer, Int4Linear):
        return int4_from(int4_values(layer)[rows], layer.scales_and_zeros[:, rows], bias, layer.group_size)
    if isinstance(layer, Dot8Linear):
        return Dot8Linear.from_portable(dot8_parts(layer, rows), bias, layer.digits)
    raise TypeError(f"cannot shard {type(layer).__name__}")


def take_cols(layer: nn.Module, lo: int, hi: int, keep_bias: bool) -> nn.Module:
    """Input columns lo..hi of a linear layer (row parallel); the bias stays on one rank only."""
    if isinstance(layer, nn.Linear):
        return float_linear(layer.weight[:, lo:hi], layer.bias if keep_bias else None)
    bias = layer.bias if keep_bias else None
    if isinstance(layer, W8A8Linear):
        return W8A8Linear(layer.qweight[:, lo:hi], layer.scales, bias, layer.digits)
    if isinstance(layer, Int8Linear):
        return Int8Linear(layer.qweight[:, lo:hi], layer.scales, bias)
    if isinstance(layer, Int4Linear):
        g = layer.group_size
        if lo % g or hi % g:
            raise ValueError(f"int4 columns {lo}..{hi} do not fall on groups of {g}")
        return int4_from(int4_values(layer)[:, lo:hi], layer.scales_and_zeros[lo // g: hi // g], bias, g)
    if isinstance(layer, Dot8Linear):
        if lo % GROUP or hi % GROUP:
            raise ValueError(f"dot8 columns {lo}..{hi} do not fall on groups of {GROUP}")
        return Dot8Linear.from_portable(dot8_parts(layer, lo=lo, hi=hi), bias, layer.digits)
    raise TypeError(f"cannot shard {type(layer).__name__}")


# ---- modules that talk to the other ranks ----------------------------------------------


def all_reduce_output(group: dist.ProcessGroup | None):
    """A forward hook summing a module's output over the group (the end of a row-parallel half)."""
    def hook(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(output, group=group)
        return output
    return hook


def gather_last(x: torch.Tensor, sizes: Sequence[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate every rank's (..., sizes[rank]) slice along the last dimension, in rank order."""
    width = max(sizes)
    if x.shape[-1] < width:  # all_gather takes equal shapes: pad, then trim
        x = F.pad(x, (0, width - x.shape[-1]))
    parts = [torch.empty_like(x) for _ in sizes]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)


class GatheredLinear(nn.Module):
    """A row-parallel layer done exactly (``Reduction`` "exact"): gather the input columns, multiply
    by this rank's output rows (the full inner sum, as at TP=1), gather the output slices."""

    def __init__(self, local: nn.Module, in_sizes: Sequence[int], out_sizes: Sequence[int],
                 group: dist.ProcessGroup | None):
        super().__init__()
        self.local, self.in_sizes, self.out_sizes, self.group = local, list(in_sizes), list(out_sizes), group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather_last(self.local(gather_last(x, self.in_sizes, self.group)), self.out_sizes, self.group)


class VocabParallelEmbedding(nn.Module):
    """Rows lo..hi of an embedding; other ids give zeros here and their owner's row after the sum."""

    def __init__(self, local: nn.Module, lo: int, hi: int, group: dist.ProcessGroup | None):
        super().__init__()
        self.local, self.lo, self.hi, self.group = local, lo, hi, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        inside = (ids >= self.lo) & (ids < self.hi)
        x = self.local((ids - self.lo).clamp(0, self.hi - self.lo - 1))  # (tokens, hidden)
        x = x.masked_fill(~inside[..., None], 0)
        dist.all_reduce(x, group=self.group)
        return x

    @property
    def weight(self) -> torch.Tensor:
        """This rank's (hi - lo, hidden) rows."""
        return self.local.weight


class VocabParallelHead(nn.Module):
    """Output rows lo..hi of the head; the slices are gathered into (tokens, vocab) logits."""

    def __init__(self, local: nn.Module, sizes: Sequence[int], group: dist.ProcessGroup | None):
        super().__init__()
        self.local, self.sizes, self.group = local, list(sizes), group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return gather_last(self.local(hidden), self.sizes, self.group)  # (tokens, vocab)

    def dequantize(self) -> torch.Tensor:
        """This rank's rows as floats (``linear_weight``)."""
        return self.local.weight if isinstance(self.local, nn.Linear) else self.local.dequantize()


# ---- the model -------------------------------------------------------------------------


class CoreSharder:
    """Shards transformers in place for one rank. Modules shared between models (a twin's base
    layers, its norms and head) map to one sharded object through ``memo``."""

    def __init__(self, shard: Shard):
        self.shard = shard
        # id(module) -> (module, its shard); the module is held so its id is not reused meanwhile.
        # Drop the sharder when done: it keeps the unsharded modules alive.
        self.memo: dict[tuple[int, bool | str], tuple[nn.Module, nn.Module]] = {}

    def once(self, old: nn.Module, make, variant: bool | str = False) -> nn.Module:
        key = (id(old), variant)
        if key not in self.memo:
            new = make(old)
            self.memo[key] = (old, new)
            self.memo[(id(new), variant)] = (new, new)  # already sharded maps to itself
        return self.memo[key][1]

    def rows(self, layer: nn.Module, rows: torch.Tensor, whole_input: bool = False) -> nn.Module:
        """Output rows of ``layer`` (``whole_input``: of a row-parallel layer done exactly, a module
        distinct from a column-parallel slice of the same layer)."""
        if isinstance(layer, LoRA):  # B's rows follow the base's; A sees the whole input
            return self.once(layer, lambda m: LoRA(self.rows(m.base, rows, whole_input), m.down,
                                                   take_rows(m.up, rows)), whole_input)
        return self.once(layer, lambda m: take_rows(m, rows), whole_input)

    def row_parallel(self, layer: nn.Module, in_sizes: Sequence[int], owner: nn.Module) -> nn.Module:
        """``layer`` (input split by ``in_sizes``) as this rank's part of a row-parallel layer: its input
        columns, summed by a hook on ``owner`` ("sum"), or its output rows, gathered ("exact")."""
        if self.shard.reduction == "sum":
            owner.register_forward_hook(all_reduce_output(self.shard.group))
            return self.cols(layer, *span(in_sizes, self.shard.rank))
        out = layer.base.out_features if isinstance(layer, LoRA) else layer.out_features
        unit = 16 if out % (16 * self.shard.world) == 0 else 1  # the CPU int4 packing takes rows in 16s
        out_sizes = split_sizes(out, self.shard.world, unit)
        lo, hi = span(out_sizes, self.shard.rank)
        return self.once(layer, lambda m: GatheredLinear(self.rows(m, torch.arange(lo, hi), whole_input=True),
                                                         in_sizes, out_sizes, self.shard.group))

    def cols(self, layer: nn.Module, lo: int, hi: int) -> nn.Module:
        if isinstance(layer, LoRA):  # A's columns follow the base's; each rank adds its partial product
            return self.once(layer, lambda m: LoRA(self.cols(m.base, lo, hi), take_cols(m.down, lo, hi, False),
                                                   m.up))
        return self.once(layer, lambda m: take_cols(m, lo, hi, keep_bias=self.shard.rank == 0))

    def attention(self, attn: Attention) -> None:
        rank, world = self.shard.rank, self.shard.world
        group = attn.num_heads // attn.num_kv_heads
        kv_lo, kv_hi = span(split_sizes(attn.num_kv_heads, world), rank)
        d = attn.head_dim
        q_size, kv_size = attn.num_heads * d, attn.num_kv_heads * d
        q = torch.arange(kv_lo * group * d, kv_hi * group * d)
        kv = torch.arange(kv_lo * d, kv_hi * d)
        attn.qkv_proj = self.rows(attn.qkv_proj, torch.cat([q, q_size + kv, q_size + kv_size + kv]))
        widths = [n * group * d for n in split_sizes(attn.num_kv_heads, world)]
        attn.o_proj = self.row_parallel(attn.o_proj, widths, attn)
        attn.num_heads, attn.num_kv_heads = (kv_hi - kv_lo) * group, kv_hi - kv_lo
        attn.split = (attn.num_heads * d, attn.num_kv_heads * d, attn.num_kv_heads * d)

    def mlp(self, mlp: SwiGLU, intermediate: int) -> None:
        # Whole int4 groups where the size allows (a quantized layer needs them; tiny float models do not).
        unit = GROUP if intermediate % GROUP == 0 and intermediate // GROUP >= self.shard.world else 1
        sizes = split_sizes(intermediate, self.shard.world, unit)
        lo, hi = span(sizes, self.shard.rank)
        rows = torch.cat([torch.arange(lo, hi), intermediate + torch.arange(lo, hi)])
        mlp.gate_up_proj = self.rows(mlp.gate_up_proj, rows)
        mlp.down_proj = self.row_parallel(mlp.down_proj, sizes, mlp)

    def embedding(self, emb: nn.Module, vocab: int) -> nn.Module:
        if isinstance(emb, MaskedEmbedding):  # a twin's [MASK] row goes in after the sum
            return self.once(emb, lambda m: MaskedEmbedding(self.embedding(m.base, vocab), m.mask_token_id, m.row))
        lo, hi = span(split_sizes(vocab, self.shard.world), self.shard.rank)

        def make(m: nn.Module) -> nn.Module:
            if isinstance(m, HeadRowsEmbedding):  # reads this rank's rows of the head, the head's shard
                local = HeadRowsEmbedding(self.vocab_rows(m.head, vocab), m.dtype)
            elif isinstance(m, QuantEmbedding):
                local = QuantEmbedding(m.qweight[lo:hi].clone(), m.scales[lo:hi].clone(), m.dtype)
            elif isinstance(m, nn.Embedding):
                local = nn.Embedding(hi - lo, m.embedding_dim, device="meta")
                local.weight = nn.Parameter(m.weight[lo:hi].clone(), requires_grad=False)
            else:
                raise TypeError(f"cannot shard {type(m).__name__}")
            return VocabParallelEmbedding(local, lo, hi, self.shard.group)
        return self.once(emb, make)

    def head(self, model: Transformer) -> nn.Module:
        sizes = split_sizes(model.config.vocab_size, self.shard.world)
        lo, hi = span(sizes, self.shard.rank)
        if model.lm_head is None:  # tied: the head is this rank's embedding rows, the same tensor
            emb = model.embed_tokens
            local = nn.Linear(emb.weight.shape[1], hi - lo, bias=False, device="meta")
            local.weight = emb.weight
            return VocabParallelHead(local, sizes, self.shard.group)
        vocab = model.config.vocab_size
        return self.once(model.lm_head, lambda m: VocabParallelHead(self.vocab_rows(m, vocab), sizes, self.shard.group))

    def vocab_rows(self, head: nn.Module, vocab: int) -> nn.Module:
        """This rank's vocabulary rows of an output head: one module for the head and for a tied
        embedding that reads the head's rows (``HeadRowsEmbedding``)."""
        lo, hi = span(split_sizes(vocab, self.shard.world), self.shard.rank)
        return self.once(head, lambda m: take_rows(m, torch.arange(lo, hi)), variant="vocab")

    def __call__(self, model: Transformer) -> Transformer:
        """Shard ``model`` in place (its layers, embedding and head) and return it."""
        cfg = model.config
        for layer in model.layers:
            layer: DecoderLayer
            self.attention(layer.self_attn)
            self.mlp(layer.mlp, cfg.intermediate_size)
        model.embed_tokens = self.embedding(model.embed_tokens, cfg.vocab_size)
        model.lm_head = self.head(model)
        # KV caches are sized from the config: this rank stores its own KV heads only.
        model.config = cfg.replace(num_heads=model.layers[0].self_attn.num_heads,
                                   num_kv_heads=model.layers[0].self_attn.num_kv_heads)
        return model


def sharded_modules(model: Transformer) -> list[nn.Module]:
    """The modules tensor parallelism splits: layer projections, embedding, output head."""
    mods = [model.embed_tokens] + ([model.lm_head] if model.lm_head is not None else [])
    for layer in model.layers:
        mods += [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    return mods


def cannot_split(config: ModelConfig, world: int) -> str | None:
    """Why ``world`` ranks cannot share a transformer of this config (``most_ranks``), or None."""
    most, limit = most_ranks(config.num_kv_heads, config.intermediate_size, config.vocab_size)
    return None if world <= most else f"{limit}, so at most {most} ranks"
