"""The network contract: what the engine, the loader and tensor parallelism ask of a model.

A network is an ``nn.Module`` built from its family's config (``families.py`` names the class).
It never owns a KV cache or knows of ranks: every entry point takes flattened tokens, their
positions and one ``AttentionBackend`` that stores and reads keys and values.

  * ``forward`` (causal networks: the transformer core): hidden states and the aux layers' states;
  * ``logits``: hidden rows -> logits over the vocabulary;
  * ``config.kv_shapes`` / ``config.windows``: per layer, the cached (kv heads, head size) and the
    sliding window, from which the runner sizes its KV tensors and masks;
  * ``encode`` / ``denoise`` (encoder-denoiser networks, such as DiffusionGemma): the encoder writes
    the prefix's keys and values; the denoiser returns a canvas's logits and writes nothing;
  * ``attention_kernel`` (optional): the network's own attention, which the engine's backend then
    runs over the paged KV instead of the core's.

How a network shards is its family's business, never the network's: the family row names a sharder,
the modules it splits and the rule that refuses a rank count (``families.Family``). The engine
asks ``families.family(config.family)`` for anything about the family; it never tests a class.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence, runtime_checkable

import torch

from .attention import AttentionBackend


class NetworkConfig(Protocol):
    """The fields every family's config has (``ModelConfig``, ``DiffusionGemmaConfig``)."""

    family: str                        # the row in ``families.FAMILIES``
    vocab_size: int
    num_layers: int
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None

    @property
    def kv_shapes(self) -> tuple[tuple[int, int], ...]:
        """Per layer: (kv heads, head size) of its cached keys and values."""
        ...

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Per layer: the sliding window, or None for a layer that sees every cached token."""
        ...

    @property
    def is_diffusion(self) -> bool:
        """Whether the network denoises canvases rather than decoding token by token."""
        ...


class Network(Protocol):
    """What every family's network declares (see the module docstring)."""

    config: NetworkConfig

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(rows, hidden) -> (rows, vocab)."""
        ...


@runtime_checkable
class CausalNetwork(Network, Protocol):
    """A network run one forward per step (the transformer core: AR, diffusion and twins)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                inputs_embeds: torch.Tensor | None = None,
                aux_layers: Sequence[int] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(tokens,) ids and positions -> (hidden (tokens, hidden), the aux layers' hidden states)."""
        ...


@runtime_checkable
class EncoderDenoiser(Network, Protocol):
    """A network whose encoder caches a prefix and whose denoiser refines a canvas over it."""

    def encode(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> None:
        """Run the encoder over (tokens,) ids: its keys and values are what ``attn`` stores."""
        ...

    def denoise(self, canvas_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                self_conditioning_logits: torch.Tensor | None = None,
                self_conditioning_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Denoiser logits (tokens, vocab) for flattened canvases; writes no keys or values."""
        ...


# A network's own attention kernel: q (q_len, heads, d), k and v (kv_len, kv_heads, d), an optional
# (q_len, kv_len) bool mask, causal -> (q_len, heads, d).
AttentionKernel = Callable[..., torch.Tensor]


def attention_kernel(network: Network) -> AttentionKernel | None:
    """The network's own attention kernel, when it declares one (else the core's backends serve it)."""
    return getattr(network, "attention_kernel", None)
