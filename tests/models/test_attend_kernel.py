"""The rows-form attention kernel (``dualserve::attend_rows``): it computes what the traced rows
form computes, its AVX-512 and plain C paths agree bit for bit, and a token's output is the same
bits whether it is decoded alone or verified inside a tree of new tokens."""

from __future__ import annotations

import pytest
import torch

from dualserve.decoders.engine.attention.padded import PaddedPagedAttention
from dualserve.models import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C++ compiler for the kernels")

H, KV, D, SLOTS = 6, 2, 64, 300


def cache(dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    return torch.randn(SLOTS, KV, D, generator=g).to(dtype), torch.randn(SLOTS, KV, D, generator=g).to(dtype)


def step(T: int, W: int, tree: torch.Tensor | None = None, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g)
    k, v = torch.randn(T, KV, D, generator=g).bfloat16().float(), torch.randn(T, KV, D, generator=g).bfloat16().float()
    rows = torch.arange(T).view(1, T)
    context = torch.randperm(SLOTS - 50, generator=g)[:W].view(1, W)
    mask = torch.zeros(1, T, W + T, dtype=torch.bool)
    mask[0, :, :W] = True
    mask[0, :, W:] = torch.tril(torch.ones(T, T, dtype=torch.bool)) if tree is None else tree
    return q, k, v, rows, context, mask


def traced_rows_form(q, k, v, kc, vc, rows, context, mask) -> torch.Tensor:
    """``PaddedPagedAttention._rows`` on the same inputs (the form inductor compiles)."""
    attn = PaddedPagedAttention(torch.stack([kc, vc]), None, rows, context, mask, False)
    S, Q = rows.shape
    T = q.shape[0]
    pad = q.new_zeros(1, H, D)
    qx = torch.cat([q, pad])[rows].view(S, Q, KV, H // KV, D)
    kx, vx = torch.cat([k, pad[:, :KV]])[rows], torch.cat([v, pad[:, :KV]])[rows]
    out = attn._rows(qx, kx, vx, kc[context].float(), vc[context].float())
    return q.new_zeros(T + 1, H, D).index_copy_(0, rows.reshape(-1), out.reshape(S * Q, H, D))[:T]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T,W", [(1, 40), (8, 136), (5, 3)])
def test_attend_rows_matches_the_traced_rows_form(dtype: torch.dtype, T: int, W: int) -> None:
    kc, vc = cache(dtype)
    q, k, v, rows, context, mask = step(T, W)
    got = torch.ops.dualserve.attend_rows(q, k, v, kc, vc, rows, context, mask, D ** -0.5)
    torch.testing.assert_close(got, traced_rows_form(q, k, v, kc, vc, rows, context, mask), rtol=1e-5, atol=1e-5)
    scalar = torch.ops.dualserve.attend_rows(q, k, v, kc, vc, rows, context, mask, D ** -0.5, 1)
    assert torch.equal(got, scalar), "the vector and plain C paths differ"
    avx2 = torch.ops.dualserve.attend_rows(q, k, v, kc, vc, rows, context, mask, D ** -0.5, 2)
    assert torch.equal(avx2, scalar), "the AVX2 and plain C paths differ"


def test_a_token_verified_in_a_tree_gets_the_bits_it_gets_decoded_alone() -> None:
    kc, vc = cache(torch.bfloat16)
    # a tree of 6 new tokens: 0 -> 1 -> {2, 3}, 3 -> 4, 0 -> 5
    parent = [-1, 0, 1, 1, 3, 0]
    tree = torch.zeros(6, 6, dtype=torch.bool)
    for i, p in enumerate(parent):
        tree[i, i], j = True, p
        while j >= 0:
            tree[i, j], j = True, parent[j]
    q, k, v, rows, context, mask = step(6, 90, tree)
    verified = torch.ops.dualserve.attend_rows(q, k, v, kc, vc, rows, context, mask, D ** -0.5)
    for i in range(6):
        path = [j for j in range(6) if tree[i, j] and j != i]  # ancestors, in position order
        slots = torch.arange(SLOTS - 50, SLOTS - 50 + len(path))
        kc2, vc2 = kc.clone(), vc.clone()
        kc2[slots], vc2[slots] = k[path].bfloat16(), v[path].bfloat16()   # accepted earlier: now cached
        ctx = torch.cat([context[0], slots]).view(1, -1)
        alone = torch.ops.dualserve.attend_rows(q[i:i + 1].contiguous(), k[i:i + 1].contiguous(),
                                                v[i:i + 1].contiguous(), kc2, vc2, torch.zeros(1, 1, dtype=torch.long),
                                                ctx, torch.ones(1, 1, ctx.shape[1] + 1, dtype=torch.bool), D ** -0.5)
        assert torch.equal(alone[0], verified[i]), i


def test_padded_queries_and_sequences_are_left_zero() -> None:
    kc, vc = cache(torch.bfloat16)
    q, k, v, _, _, _ = step(3, 10)
    rows = torch.tensor([[0, 1], [2, 3]])        # 3 = T: a padded query of the second sequence
    context = torch.arange(20).view(2, 10)
    mask = torch.zeros(2, 2, 12, dtype=torch.bool)
    mask[:, :, :10] = True
    mask[0, :, 10:] = torch.tril(torch.ones(2, 2, dtype=torch.bool))
    mask[1, 0, 10] = True
    mask[1, 1, 11] = True
    got = torch.ops.dualserve.attend_rows(q, k, v, kc, vc, rows, context, mask, D ** -0.5)
    assert got.shape == q.shape and got.abs().sum(-1).min() > 0
    ref = traced_rows_form(q, k, v, kc, vc, rows, context, mask)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,dim", [(6, 2, 64), (5, 1, 64), (8, 1, 128), (4, 4, 32)])
def test_every_code_path_gives_the_same_bits_for_any_group_width_and_mask(heads: int, kv_heads: int,
                                                                          dim: int) -> None:
    """AVX-512, AVX2 and plain C agree bit for bit: groups of heads wider than a register block,
    head sizes the vector paths do not specialise, rows that see different keys (a tree), a
    padded query, and more keys than one block of sixteen."""
    g = torch.Generator().manual_seed(3)
    S, Q, W, T = 2, 5, 37, 9                     # the second sequence's last query is padding
    kc = torch.randn(120, kv_heads, dim, generator=g).bfloat16()
    vc = torch.randn(120, kv_heads, dim, generator=g).bfloat16()
    q = torch.randn(T, heads, dim, generator=g)
    # the step's new rows as the cache will hold them (the contract: callers pass ``as_stored``)
    k = torch.randn(T, kv_heads, dim, generator=g).bfloat16().float()
    v = torch.randn(T, kv_heads, dim, generator=g).bfloat16().float()
    rows = torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 8, T]])
    context = torch.randperm(120, generator=g)[:S * W].view(S, W)
    mask = torch.rand(S, Q, W + Q, generator=g) < 0.8
    mask[:, :, W:] &= torch.tril(torch.ones(Q, Q, dtype=torch.bool))
    mask[0, 2] = False                           # a row that sees nothing stays zero
    out = [torch.ops.dualserve.attend_rows(q, k, v, kc, vc, rows, context, mask, dim ** -0.5, path)
           for path in (0, 1, 2)]
    assert torch.equal(out[0], out[1]) and torch.equal(out[2], out[1])
    assert out[0][2].abs().sum() == 0 and out[0][3].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_threads_reused_buffers_change_no_bits(dtype: torch.dtype) -> None:
    """The kernel keeps each thread's buffers from call to call: a small step after a large one,
    whose keys and scores are left in them, gets the bits it gets first and on a new thread."""
    import threading

    kc, vc = cache(dtype)
    small, large = step(1, 40, seed=3), step(8, 240, seed=4)

    def attend(args, force: int = 0) -> torch.Tensor:
        return torch.ops.dualserve.attend_rows(*args[:3], kc, vc, *args[3:], D ** -0.5, force)

    for force in (0, 1, 2):
        first = attend(small, force)
        attend(large, force)
        again = attend(small, force)
        fresh: list[torch.Tensor] = []
        thread = threading.Thread(target=lambda: fresh.append(attend(small, force)))
        thread.start()
        thread.join()
        assert torch.equal(first, again) and torch.equal(first, fresh[0]), f"path {force}"


@pytest.mark.parametrize("dim", [64, 80, 96, 112, 128])
def test_a_prompt_chunk_after_a_long_context_gets_the_same_bits_on_every_path(dim: int) -> None:
    """A prompt chunk's rows (causal: each sees a prefix of the task's keys) over several blocks of
    keys and values, split between threads: the vector paths' blocked scores and values, and the
    head sizes whose last register block is narrower, give the plain C path's bits."""
    g = torch.Generator().manual_seed(5)
    heads, kv_heads, W, T = 9, 3, 300, 150
    kc = torch.randn(W + 10, kv_heads, dim, generator=g).bfloat16()
    vc = torch.randn(W + 10, kv_heads, dim, generator=g).bfloat16()
    q = torch.randn(T, heads, dim, generator=g)
    k = torch.randn(T, kv_heads, dim, generator=g).bfloat16().float()
    v = torch.randn(T, kv_heads, dim, generator=g).bfloat16().float()
    rows = torch.arange(T).view(1, T)
    context = torch.randperm(W + 10, generator=g)[:W].view(1, W)
    mask = torch.ones(1, T, W + T, dtype=torch.bool)
    mask[0, :, W:] = torch.tril(torch.ones(T, T, dtype=torch.bool))
    out = [torch.ops.dualserve.attend_rows(q, k, v, kc, vc, rows, context, mask, dim ** -0.5, path)
           for path in (0, 1, 2)]
    assert torch.equal(out[0], out[1]) and torch.equal(out[2], out[1])
