"""A step graph: what each compiled step runs, and how inductor builds it.

``ForwardWithFeatures`` is the module a graph is traced from: the model's forward over a padded
step (``attention/padded.py``), with paged attention inside the graph, also returning the residual
stream after the feature layers EAGLE reads. ``PACKAGE_INDUCTOR`` is inductor's settings for every
step graph on the CPU, and ``bit_exact`` says when a graph must give the eager step's very bits.

Graph attention runs as the project's kernel (``models.kernels``: ``attend_rows``) where it is
built, unless a step is made with ``attend_kernel=False`` (``CompileSpec.attend_kernel``, from
DUALSERVE_ATTEND_KERNEL=0: inductor's loops, for comparison).
"""

from __future__ import annotations

import torch

from dualserve.models import kernels
from ..attention.padded import PaddedPagedAttention


def bit_exact(model: torch.nn.Module, attend_kernel: bool = True) -> bool:
    """Whether every step of ``model`` runs the project's ops alone on the CPU (dot8 layers, the
    attention kernel, the pointwise ops), so an eager step and a compiled graph give the same bits."""
    from dualserve.models.quant import Dot8Linear

    linears = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, Dot8Linear))]
    return (attend_kernel and kernels.available() and bool(linears)
            and all(isinstance(m, Dot8Linear) for m in linears)
            and all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters()))


class ForwardWithFeatures(torch.nn.Module):
    """One step as a graph of tensors only: ``model``'s forward over a padded step, also returning
    the residual stream after the ``aux_layers``.

    Inputs: token ids (T,), positions (T,), and the padded attention's ``rows``, ``context``,
    ``mask`` and the KV pool's ``stacked`` view (see ``PaddedPagedAttention``). Outputs, flat:
    hidden (T, hidden), one (T, hidden) per feature layer, then the new keys and the new values
    (layers, T, kv_heads, head_dim) for the caller to store."""

    def __init__(self, model: torch.nn.Module, aux_layers: tuple[int, ...], chunks: bool = False,
                 attend_kernel: bool = True):
        super().__init__()
        self.model = model
        self.aux_layers = aux_layers
        self.chunks = chunks
        self.attend_kernel = attend_kernel

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor, context: torch.Tensor,
                mask: torch.Tensor, stacked: torch.Tensor) -> tuple[torch.Tensor, ...]:
        attn = PaddedPagedAttention(stacked, None, rows, context, mask, self.chunks, self.attend_kernel)
        hidden, aux = self.model(ids, pos, attn, aux_layers=self.aux_layers)
        return (hidden, *aux, torch.stack(attn.new_k), torch.stack(attn.new_v))


# Inductor's settings for step graphs on the CPU. The graph's wrapper is C++ (always so in a
# package; under torch.compile, ``cpp_wrapper``): a decode step calls some 400 kernels, and their
# Python wrapper cost about 1.5 ms of a 12 ms step. Inductor's own kernels (norms, rotary,
# softmax: small at decode) run on one thread, so a step opens OpenMP parallel regions only in the
# GEMMs, as in eager mode: every region is a barrier, and a barrier is what costs when OpenMP
# cannot spin (see ``openmp``).
#
# Casts round where the code says they do (``emulate_precision_casts``): by default inductor keeps a
# value in fp32 inside a fused kernel even where the code rounds it to bf16. A new token's key, which
# the pool stores in bf16, then entered its own step's attention unrounded but every later step's
# rounded, and a token verified in a tree (its parent's key new) differed from the same token
# decoded after its parent (the key cached): greedy EAGLE left AR's output at near-ties.
#
# The wrapper (the C++ that calls the kernels: some 77,000 lines for the default model, most of them
# checks of the weights' dtypes and strides) compiles at -O0: at inductor's -O1 it took 51 of a
# graph's 90 s of building on 2 cores, at -O0 19 s, and decode runs at the same speed. The kernels
# themselves compile at -O3 either way.
PACKAGE_INDUCTOR: dict[str, object] = {"cpp.threads": 1, "emulate_precision_casts": True,
                                       "aot_inductor.compile_wrapper_opt_level": "O0"}
