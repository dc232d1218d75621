"""A store of the target's features per training sequence, shared by the draft-model trainers.

A draft-model training step spends most of its time in the target's forward over the
batch (about two thirds of an EAGLE-3 step on 2 CPU cores), and a run visits every
sequence several times. The store keeps each sequence's features the first time the
target computes them, so later passes, and the other trainer reading the same shards,
skip that forward.

Layout: one directory per (target, weight format, layer set, dtype), named by
``FeatureStore.directory``, and in it one safetensors file per sequence, named by the
SHA-1 of its token ids: ``final`` (tokens, hidden), the post-norm last hidden state, and
``aux`` (tokens, layers x hidden), the outputs of the layers side by side. Files are
written to a temporary name and renamed, so two trainers can fill one store at once.

Features are kept in the dtype the trainer consumes them in. Under bf16 autocast every
use of a feature is a matmul input, which autocast rounds to bf16 anyway, so a bf16
store changes no result. In the quantized formats (``w4a8``, checked on the default model)
a sequence's features do not depend on the batch they were computed in either, since the
kernels sum each row in exact integers: a run that reads the store then trains exactly as
one that computes every feature. A float target's GEMMs may round a row differently in a
batch of another size, so there the two runs agree to rounding.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


class FeatureStore:
    def __init__(self, root: Path | str, target: str, quantization: str, layers: tuple[int, ...],
                 dtype: torch.dtype):
        self.dtype = dtype
        self.directory = Path(root) / self.name(target, quantization, layers, dtype)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.hits = self.misses = 0

    @staticmethod
    def name(target: str, quantization: str, layers: tuple[int, ...], dtype: torch.dtype) -> str:
        return f"{target}-{quantization}-L{','.join(map(str, layers))}-{str(dtype).removeprefix('torch.')}"

    def path(self, ids: torch.Tensor) -> Path:
        digest = hashlib.sha1(ids.to(torch.int64).cpu().numpy().tobytes()).hexdigest()
        return self.directory / digest[:2] / f"{digest}.safetensors"

    def load(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(final, aux) of the sequence ``ids``, or None when the store does not hold it."""
        path = self.path(ids)
        if not path.exists():
            self.misses += 1
            return None
        tensors = load_file(str(path))
        if tensors["final"].shape[0] != len(ids):
            raise ValueError(f"{path}: {tensors['final'].shape[0]} positions for {len(ids)} tokens")
        self.hits += 1
        return tensors["final"], tensors["aux"]

    def save(self, ids: torch.Tensor, final: torch.Tensor, aux: torch.Tensor) -> None:
        path = self.path(ids)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        save_file({"final": final.to(self.dtype).contiguous().cpu(), "aux": aux.to(self.dtype).contiguous().cpu()},
                  str(tmp))
        tmp.replace(path)


def feature_store(loaded, args, layers: tuple[int, ...]) -> FeatureStore | None:
    """The store a trainer's ``--feature-store`` names, for its target and layers, in the dtype its
    ``--bf16`` trains in; None without the flag."""
    if not getattr(args, "feature_store", None):
        return None
    return FeatureStore(args.feature_store, loaded.name, loaded.quantization, tuple(layers),
                        torch.bfloat16 if args.bf16 else torch.float32)
