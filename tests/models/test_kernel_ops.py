"""The kernel ops' wrappers (``models/kernels/ops.py``): each computes its op's bits, the attention
kernel's eligibility rule is the one both attention backends read, and nothing else in the
package calls ``torch.ops.dualserve`` directly."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from dualserve.models import kernels
from dualserve.models.kernels import ops
from dualserve.models.quant import Dot8Linear

ROOT = Path(ops.__file__).resolve().parents[2]  # the package's top level: server/, decoders/, models/, clients/
needs_kernels = pytest.mark.skipif(not kernels.available(), reason="no C++ compiler for the kernels")


def test_only_the_wrappers_and_the_loader_call_the_ops() -> None:
    allowed = {Path("models/kernels/ops.py"), Path("models/kernels/__init__.py"), Path("models/kernels/c_shims.py")}
    callers = {p.relative_to(ROOT) for top in ("server", "decoders", "models", "clients")
               for p in (ROOT / top).rglob("*.py") if re.search(r"torch\.ops\.dualserve\b", p.read_text())}
    assert callers <= allowed, sorted(map(str, callers - allowed))


def test_attend_eligibility(monkeypatch: pytest.MonkeyPatch) -> None:
    q = torch.zeros(3, 4, 64)  # (tokens, heads, head_dim)
    assert not ops.attend_eligible(q.bfloat16())
    assert not ops.attend_eligible(torch.zeros(3, 4, 24))  # head_dim not a whole number of lanes
    monkeypatch.setattr(kernels, "available", lambda: False)
    assert not ops.attend_eligible(q)
    monkeypatch.setattr(kernels, "available", lambda: True)
    assert ops.attend_eligible(q)


@needs_kernels
def test_attend_rows_wrapper_is_the_op() -> None:
    g = torch.Generator().manual_seed(0)
    T, W, H, KV, D, slots = 5, 7, 4, 2, 32, 40
    q, k, v = torch.randn(T, H, D, generator=g), torch.randn(T, KV, D, generator=g), torch.randn(T, KV, D, generator=g)
    kc, vc = torch.randn(slots, KV, D, generator=g), torch.randn(slots, KV, D, generator=g)
    rows, context = torch.arange(T).view(1, T), torch.randperm(slots, generator=g)[:W].view(1, W)
    mask = torch.ones(1, T, W + T, dtype=torch.bool)
    mask[0, :, W:] = torch.tril(torch.ones(T, T, dtype=torch.bool))
    args = (q, k, v, kc, vc, rows, context, mask, D ** -0.5)
    assert torch.equal(ops.attend_rows(*args), torch.ops.dualserve.attend_rows(*args))
    assert torch.equal(ops.attend_rows(*args, path=ops.CodePath.SCALAR), torch.ops.dualserve.attend_rows(*args, 1))


@needs_kernels
def test_pointwise_wrappers_are_the_ops() -> None:
    g = torch.Generator().manual_seed(1)
    x, w, gu = torch.randn(5, 64, generator=g), torch.randn(64, generator=g), torch.randn(5, 96, generator=g)
    assert torch.equal(ops.rms_norm(x, w, 1e-6), torch.ops.dualserve.rms_norm(x, w, 1e-6))
    assert torch.equal(ops.silu_mul(gu), torch.ops.dualserve.silu_mul(gu))
    assert torch.equal(ops.silu_mul(gu, ops.CodePath.SCALAR), torch.ops.dualserve.silu_mul(gu, 1))
    positions, inv_freq = torch.arange(6), 1.0 / 10000 ** (torch.arange(0, 32, 2).float() / 32)
    for got, want in zip(ops.rotary(positions, inv_freq), torch.ops.dualserve.rotary(positions, inv_freq)):
        assert torch.equal(got, want)


@needs_kernels
def test_dot8_wrapper_is_the_op() -> None:
    g = torch.Generator().manual_seed(2)
    layer = Dot8Linear.from_float(torch.randn(48, 64, generator=g), bits=8)
    x = torch.randn(3, 64, generator=g)
    raw = torch.ops.dualserve.dot8_linear(x, layer.packed, layer.d, layer.m, layer.out_features, layer.bits, 0,
                                          layer.digits, layer.s, layer.mn, layer.minimum)
    assert torch.equal(layer(x), raw)
    assert torch.equal(ops.dot8_linear(x, layer.packed, layer.d, layer.m, layer.out_features, layer.bits,
                                       layer.digits, layer.s, layer.mn, layer.minimum), raw)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 16, 700])  # 700 tokens of 4 layers: past the serial bound, threaded
def test_store_kv_writes_what_index_copy_writes(dtype: torch.dtype, tokens: int) -> None:
    g = torch.Generator().manual_seed(tokens)
    layers, slots, heads, dim = 4, 1024, 3, 64
    base = torch.randn(2 * layers * slots * heads * dim, generator=g).to(dtype)
    pool = torch.as_strided(base, (2 * layers, slots, heads, dim), (slots * heads * dim, heads * dim, dim, 1))
    want = pool.clone()
    k = torch.randn(layers, tokens, heads, dim, generator=g).to(dtype)
    v = torch.randn(layers, tokens, heads, dim, generator=g).to(dtype)
    at = torch.randperm(slots, generator=g)[:tokens]
    want.index_copy_(1, at, torch.cat([k, v]))
    assert ops.store_eligible(pool)
    ops.store_kv(pool, at, k, v)
    assert torch.equal(pool, want)


@needs_kernels
def test_store_kv_refuses_what_it_cannot_store() -> None:
    pool = torch.zeros(4, 32, 3, 64, dtype=torch.bfloat16)
    k = torch.zeros(2, 2, 3, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.store_kv(pool, torch.tensor([0, 32]), k, k)
    with pytest.raises(RuntimeError, match="dtype"):
        ops.store_kv(pool, torch.tensor([0, 1]), k.float(), k.float())
    assert not ops.store_eligible(pool.transpose(2, 3))  # a slot's values not contiguous
