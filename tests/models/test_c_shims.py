"""A compiled package calls every one of the project's ops through its C entry point
(``models/kernels/c_shims.py``, ``c_shim.h``), never through the proxy executor, and gets the bits
the dispatcher's call gives: tensors, optional tensors given and absent, ints, floats, bools, and
an op with two outputs. The package is built by the production path (``aoti_build.build_here``)."""

from __future__ import annotations

import zipfile

import pytest
import torch

from dualserve.decoders.engine.compile import aoti, aoti_build
from dualserve.models import kernels
from dualserve.models.kernels import c_shims, ops
from dualserve.models.quant import Dot8Linear

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C++ compiler for the kernels")

K, N, RANK = 64, 96, 32


def layer_tensors(layer: Dot8Linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return layer.packed, layer.d, layer.m


class EveryOp(torch.nn.Module):
    """One call of each op, chained so that each output feeds the next."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        # int4 with multipliers (the K-quants' form: s and mn given), int8 without (s and mn None).
        q = torch.randint(0, 16, (N, K), generator=g)
        scales, mins = torch.rand(N, K // 32, generator=g) / 8, -torch.rand(N, K // 32, generator=g) / 8
        self.kq = Dot8Linear(q, scales, mins, 4, digits=2,
                             scale_mult=torch.randint(1, 8, (N, K // 32, 2), generator=g, dtype=torch.int8),
                             zero_mult=torch.randint(1, 8, (N, K // 32), generator=g, dtype=torch.int8))
        self.plain = Dot8Linear.from_float(torch.randn(2 * K, N, generator=g), bits=8)
        self.down = Dot8Linear.from_float(torch.randn(RANK, K, generator=g), bits=8)
        self.up = Dot8Linear.from_float(torch.randn(N, RANK, generator=g), bits=8)
        self.norm = torch.nn.Parameter(torch.rand(K, generator=g) + 0.5, requires_grad=False)

    def forward(self, x, positions, inv_freq, q, k, v, kc, vc, rows, context, mask):
        h = ops.rms_norm(x, self.norm, 1e-6)
        a = ops.dot8_linear(h, *layer_tensors(self.kq), N, 4, 2, self.kq.s, self.kq.mn, True)
        b = ops.dot8_lora(h, *layer_tensors(self.kq), N, 4, layer_tensors(self.down), RANK, layer_tensors(self.up), 2,
                          self.kq.s, self.kq.mn, True)
        gu = ops.dot8_linear(torch.cat([a, b], -1)[:, N // 2:N + N // 2].contiguous(), *layer_tensors(self.plain), 2 * K, 8)
        cos, sin = ops.rotary(positions, inv_freq)
        attended = ops.attend_rows(q * cos[:, None, :], k * sin[:, None, :], v, kc, vc, rows, context, mask, 0.125)
        return ops.silu_mul(gu), attended


def example() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    T, W, H, KV, D, slots = 5, 7, 4, 2, 32, 40
    mask = torch.ones(1, T, W + T, dtype=torch.bool)
    mask[0, :, W:] = torch.tril(torch.ones(T, T, dtype=torch.bool))
    return (torch.randn(T, K, generator=g), torch.arange(T) + 3, 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D),
            torch.randn(T, H, D, generator=g), torch.randn(T, KV, D, generator=g), torch.randn(T, KV, D, generator=g),
            torch.randn(slots, KV, D, generator=g), torch.randn(slots, KV, D, generator=g),
            torch.arange(T).view(1, T), torch.randperm(slots, generator=g)[:W].view(1, W), mask)


def test_the_declarations_follow_the_schemas() -> None:
    shims = {op.name(): lines for op, lines in c_shims.declarations().items()}
    assert sorted(shims) == sorted(f"dualserve::{name}" for name in c_shims.OPS)
    assert shims["dualserve::rotary"] == [
        "AOTITorchError aoti_torch_cpu_rotary(AtenTensorHandle positions, AtenTensorHandle inv_freq, "
        "AtenTensorHandle* ret0, AtenTensorHandle* ret1)"]
    assert ("AtenTensorHandle* s, AtenTensorHandle* mn, int32_t minimum, AtenTensorHandle* ret0)"
            in shims["dualserve::dot8_linear"][0])


def test_a_package_calls_the_ops_directly_with_the_dispatcher_s_bits(tmp_path) -> None:
    module, inputs = EveryOp().eval(), example()
    with torch.inference_mode():
        want = module(*inputs)
    package = tmp_path / "every-op.pt2"
    # Built in this process, not the server's child: inductor notes the package's metadata in its
    # global config as it compiles, which the suite's fixture requires be left as it was.
    import torch._inductor.config as inductor

    with inductor.patch({"aot_inductor.metadata": dict(inductor.aot_inductor.metadata)}):
        aoti_build.build_here(module, inputs, tuple({} for _ in inputs), package, {"cpp.threads": 1})
    with zipfile.ZipFile(package) as z:
        wrapper = next(z.read(n).decode() for n in z.namelist() if n.endswith(".wrapper.cpp"))
    for name in c_shims.OPS:
        assert f"AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_cpu_{name}(" in wrapper, f"{name} is not called directly"
    assert "proxy_executor_call_function" not in wrapper
    with torch.inference_mode():
        got = aoti.PackagedGraph(package, module)(*inputs)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
