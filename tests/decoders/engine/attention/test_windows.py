"""Sliding-window layers (Gemma 3's local layers) through the paged engine.

A tiny random Gemma 3 with a window of 4 runs a 13-token prompt through ``ModelRunner``: in
chunks, then token by token, then with a draft tree beyond the window, each in a batch beside a
sequence that does not reach the window. Every row must equal one dense forward over the whole
prompt (``DenseAttention`` with the same windows), with the project's rows kernel and without
it (SDPA over full masks).
"""

from __future__ import annotations

import pytest
import torch

from dualserve.decoders.engine.runner import ForwardItem, ModelRunner
from dualserve.models import kernels
from dualserve.models.attention import DenseAttention
from dualserve.models.config import ModelConfig
from dualserve.models.transformer import Transformer

WINDOW, LENGTH, BS = 4, 13, 4


def tiny_gemma() -> Transformer:
    config = ModelConfig(family="gemma3", vocab_size=61, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                         head_dim=16, intermediate_size=96, qk_norm=True, activation="gelu_tanh", sandwich_norms=True,
                         scale_embeddings=True, sliding_window=WINDOW, sliding_layers=(True, False, True),
                         rope_local_theta=10000.0, rope_theta=1e6, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Transformer(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape) if name.endswith("norm.weight")
                    else torch.randn(p.shape) / (p.shape[-1] ** 0.5 if p.dim() > 1 else 1))
    return model.eval()


def dense_logits(model: Transformer, ids: list[int]) -> torch.Tensor:
    n = len(ids)
    hidden, _ = model(torch.tensor(ids), torch.arange(n), DenseAttention([n], windows=model.config.windows))
    return model.logits(hidden)


@pytest.fixture(params=["rows kernel", "sdpa"])
def backend(request, monkeypatch):
    if request.param == "rows kernel" and not kernels.available():
        pytest.skip("the project's kernels are not built here")
    if request.param == "sdpa":
        monkeypatch.setattr(kernels, "available", lambda: False)
    return request.param


@torch.inference_mode()
def test_windowed_steps_match_one_dense_forward(backend) -> None:
    model = tiny_gemma()
    ids = torch.randint(0, 61, (LENGTH,), generator=torch.Generator().manual_seed(1)).tolist()
    short = ids[:3]
    want, want_short = dense_logits(model, ids), dense_logits(model, short)
    runner = ModelRunner(model, 16, BS)
    table, other = [0, 1, 2, 3], [8]

    def item(tokens: list[int], start: int, blocks: list[int], mask="causal") -> ForwardItem:
        positions = list(range(start, start + len(tokens)))
        slots = [blocks[p // BS] * BS + p % BS for p in positions]
        return ForwardItem(tokens, positions, start, blocks, slots, mask)

    # a prompt in chunks of 6, 5 and 2, beside a short sequence that never reaches the window
    got, start = [], 0
    for size in (6, 5):
        hidden, _ = runner.forward([item(ids[start:start + size], start, table)] +
                                   ([item(short, 0, other)] if start == 0 else []))
        got.append(runner.logits(hidden)[:size])
        if start == 0:
            torch.testing.assert_close(runner.logits(hidden)[size:], want_short, atol=1e-5, rtol=0)
        start += size
    # then the last two tokens one at a time
    for p in range(start, LENGTH):
        hidden, _ = runner.forward([item([ids[p]], p, table)])
        got.append(runner.logits(hidden))
    torch.testing.assert_close(torch.cat(got), want, atol=1e-5, rtol=0)

    # a draft chain written as a tree mask (each node sees its ancestors): the same rows as decoding it
    tree = torch.ones(3, 3, dtype=torch.bool).tril()
    hidden, _ = runner.forward([item(ids[LENGTH - 3:], LENGTH - 3, table, mask=tree)])
    torch.testing.assert_close(runner.logits(hidden), want[LENGTH - 3:], atol=1e-5, rtol=0)
