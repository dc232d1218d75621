"""Tensor parallelism's entry point: shard any loaded network for one rank, by its family's sharder.

Each family row (``families.py``) names the sharder that splits its network, the modules that
sharder splits and the rule that refuses a rank count; this module asks the row and knows no family.
The transformer core's sharder and the slicing primitives every sharder shares are in
``sharding_core.py``; a family with its own layers brings its own (``sharding_gemma.py``).

One ``Sharder`` serves every model of a deployment: a sharder of each kind is made once, so
modules two models share (a twin's base layers) are split once and both get the same shard.
"""

from __future__ import annotations

from torch import nn

from .families import family
from .network import Network
from .sharding_core import Reduction, Shard, most_ranks, span, split_sizes, take_cols, take_rows

__all__ = ["Reduction", "Shard", "Sharder", "most_ranks", "sharded_bytes", "span", "split_sizes", "take_cols",
           "take_rows"]


class Sharder:
    """Shards networks in place for one rank, each by its family's sharder (one of each kind)."""

    def __init__(self, shard: Shard):
        self.shard = shard
        self.sharders: dict[type, object] = {}  # a family's sharder class -> its one instance here

    def __call__(self, model: Network) -> Network:
        """Shard ``model`` in place and return it."""
        kind = family(model.config.family).sharder
        if kind not in self.sharders:
            self.sharders[kind] = kind(self.shard)
        return self.sharders[kind](model)


def sharded_bytes(model: Network) -> int:
    """Bytes of the tensors tensor parallelism splits (the family's ``sharded_modules``), each
    tensor counted once."""
    seen: set[int] = set()
    total = 0
    for m in family(model.config.family).sharded_modules(model):
        m: nn.Module
        for t in list(m.parameters()) + list(m.buffers()):
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total
