"""The transformer's norms, SwiGLU and rotary angles as the project's ops (``pointwise.cpp``): the
reference's values, and each row's bits independent of the rows beside it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dualserve.models import kernels
from dualserve.models.config import ModelConfig, rope_inv_freq

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C++ compiler for the project's kernels")


@pytest.mark.parametrize("width", [64, 576, 1000])  # 1000: not a multiple of the sixteen lanes
def test_rms_norm(width: int) -> None:
    torch.manual_seed(0)
    x, w = torch.randn(9, width) * 3, torch.randn(width)
    got = torch.ops.dualserve.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(got, F.rms_norm(x, (width,), eps=1e-5) * w, rtol=1e-6, atol=1e-6)
    assert torch.equal(torch.cat([torch.ops.dualserve.rms_norm(x[i:i + 1], w, 1e-5) for i in range(9)]), got)


@pytest.mark.parametrize("inner", [96, 1536, 37, 8192 + 37])  # the last: rows split across threads in chunks, with tails
def test_silu_mul(inner: int) -> None:
    torch.manual_seed(1)
    gu = torch.randn(7, 2 * inner) * 6
    gu[0, :4] = torch.tensor([0.0, -0.0, 90.0, -90.0])  # zero, both signs, far beyond exp's range
    got = torch.ops.dualserve.silu_mul(gu)
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=1e-5, atol=1e-6)
    assert torch.equal(torch.cat([torch.ops.dualserve.silu_mul(gu[i:i + 1]) for i in range(7)]), got)
    # every exp path a host may take (plain C; AVX2 where the CPU has it) gives the widest path's bits
    for force in (1, 2):
        assert torch.equal(torch.ops.dualserve.silu_mul(gu, force), got), force


def test_rotary_angles_are_the_reference_ones() -> None:
    cfg = ModelConfig(family="llama", vocab_size=8, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=32, intermediate_size=8, rope_theta=10000.0)
    inv = rope_inv_freq(cfg)
    positions = torch.tensor([0, 1, 7, 300, 8191])
    cos, sin = torch.ops.dualserve.rotary(positions, inv)
    angles = positions.float()[:, None] * inv[None, :]
    torch.testing.assert_close(cos, torch.cat([angles.cos(), angles.cos()], -1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin, torch.cat([angles.sin(), angles.sin()], -1), rtol=1e-6, atol=1e-6)
    one, _ = torch.ops.dualserve.rotary(positions[3:4], inv)
    assert torch.equal(one, cos[3:4])


def test_without_the_kernels_the_model_takes_pytorchs_ops(tmp_path) -> None:
    """A host without a C++ compiler (here DUALSERVE_NO_KERNELS=1): the dot8 formats are not offered,
    and the model's norms, SwiGLU and rotary angles run as PyTorch's ops, close to the kernels' values."""
    import os
    import subprocess
    import sys

    from dualserve.models.attention import DenseAttention
    from tiny_engine import tiny

    ids = torch.arange(3, 40)
    with torch.inference_mode():
        want, _ = tiny()(ids, torch.arange(len(ids)), DenseAttention([len(ids)]))
    torch.save({"ids": ids, "want": want}, tmp_path / "job.pt")
    code = ("import sys, torch; from dualserve.models import formats, kernels; "
            "from dualserve.models.attention import DenseAttention; sys.path.insert(0, sys.argv[2]); "
            "from tiny_engine import tiny; job = torch.load(sys.argv[1]); "
            "assert not kernels.available() and not set(formats.runnable()) & {'w4a8', 'w4a16'}; "
            "assert not kernels.pointwise(torch.zeros(1)); "
            "got, _ = tiny()(job['ids'], torch.arange(len(job['ids'])), DenseAttention([len(job['ids'])])); "
            "torch.testing.assert_close(got, job['want'], rtol=1e-4, atol=1e-4)")
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "job.pt"), tests],
                          env={**os.environ, "DUALSERVE_NO_KERNELS": "1"}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
