"""The project's own CPU kernels: ``dualserve::dot8_linear`` (``dot8.cpp``),
``dualserve::attend_rows`` (``attend.cpp``, paged attention for every query length: each query
row over its visible keys alone, so decode, verify and prefill agree bit for bit), and the
transformer's norms, SwiGLU and rotary angles (``pointwise.cpp``), so that eager steps and compiled
graphs compute them with the same bits.

PyTorch's weight-only kernels widen every weight to a float and multiply in
floats: at one token they stream the weights as fast as memory allows, but each
more token costs another pass of float work, so eight tokens (an EAGLE verify, a
diffusion block) cost 2.4x one on a 2-core AVX-512 host. ``dot8`` multiplies the
way llama.cpp does: activations are quantized per row to int8 groups of 32, each
group's dot product with the int4 or int8 weight group is an exact integer sum
(AVX512-VNNI ``vpdpbusd``: 64 multiply-adds per instruction), and a weight group
is unpacked once for up to eight rows. Integer sums are exact, so a row's result
does not depend on how many rows came with it, on the thread count, or on which
code path (AVX512-VNNI, AVX2, plain C) the host runs.

The sources are compiled at first use with the host's C++ compiler (about 30 s) into
``<cache>/kernels/`` under a name that hashes the sources, the compiler and the
torch build, and loaded with ``torch.ops.load_library``. Without a compiler (or with
``DUALSERVE_NO_KERNELS=1``) the kernels are reported unavailable: the formats that need
them are not offered and attention keeps inductor's loops.
The code path is chosen at run time from the CPU's flags, never at compile time,
so one build serves every CPU.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import torch

SOURCES = tuple(Path(__file__).with_name(n) for n in ("dot8.cpp", "attend.cpp", "pointwise.cpp"))
HEADERS = (Path(__file__).with_name("exp.h"),)
TILE = 16
GROUP = 32
_loaded: bool | None = None
_error: str | None = None


def _cache_dir() -> Path:
    from ..hub import default_cache_dir
    return default_cache_dir() / "kernels"


def _flags() -> list[str]:
    from torch.utils.cpp_extension import include_paths, library_paths
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    inc = [f"-I{p}" for p in include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    lib = library_paths()[0]
    return ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *inc, f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch_cpu"]


def _compiler() -> str:
    return os.environ.get("CXX", "g++")


@functools.cache  # the sources and the compiler do not change within a process
def library_path() -> Path:
    """Where this source, compiler and torch build's library lives (built or not)."""
    try:
        version = subprocess.run([_compiler(), "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise RuntimeError(f"no C++ compiler ({_compiler()}): {e}") from e
    texts = [s.read_text() for s in SOURCES + HEADERS]
    key = hashlib.sha256("\n".join([*texts, version, torch.__version__, sys.version,
                                    " ".join(_flags())]).encode()).hexdigest()[:16]
    return _cache_dir() / f"dualserve-kernels-{key}.so"


def build() -> Path:
    """Compile the kernel if this machine has not yet (one process at a time, atomically)."""
    so = library_path()
    if so.exists():
        return so
    so.parent.mkdir(parents=True, exist_ok=True)
    with open(so.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not so.exists():
            tmp = so.with_suffix(f".{os.getpid()}.tmp")
            cmd = [_compiler(), *map(str, SOURCES), "-o", str(tmp), *_flags()]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                tmp.unlink(missing_ok=True)
                raise RuntimeError(f"building the kernels failed:\n{done.stderr[-4000:]}")
            tmp.rename(so)
    return so


def available() -> bool:
    """Whether ``torch.ops.dualserve.dot8_linear`` can run here (built and loaded on first call)."""
    global _loaded, _error
    if _loaded is None and os.environ.get("DUALSERVE_NO_KERNELS"):
        _loaded, _error = False, "DUALSERVE_NO_KERNELS is set"
    if _loaded is None:
        try:
            if not hasattr(torch.ops.dualserve, "dot8_linear"):
                torch.ops.load_library(str(build()))
                _register_fake()
            _loaded = True
        except (RuntimeError, OSError) as e:
            _loaded, _error = False, str(e)
    return _loaded


def unavailable_reason() -> str | None:
    available()
    return _error


def code_path() -> str:
    """The instruction set the kernel runs with on this CPU: avx512_vnni, avx2 or scalar."""
    if not available():
        raise RuntimeError(_error)
    return torch.ops.dualserve.dot8_path()


def _register_fake() -> None:
    @torch.library.register_fake("dualserve::dot8_linear")
    def _(x, q, d, m, n, bits, force_scalar=0, digits=1):
        return x.new_empty((x.shape[0], n), dtype=torch.float32)

    @torch.library.register_fake("dualserve::dot8_lora")
    def _(x, q, d, m, n, bits, qa, da, ma, rank, qb, db, mb, force_scalar=0, digits=1):
        return x.new_empty((x.shape[0], n), dtype=torch.float32)

    @torch.library.register_fake("dualserve::attend_rows")
    def _(q, k, v, kc, vc, rows, context, mask, scale, force_scalar=0):
        return q.new_empty(q.shape)

    @torch.library.register_fake("dualserve::rms_norm")
    def _(x, w, eps):
        return x.new_empty(x.shape)

    @torch.library.register_fake("dualserve::silu_mul")
    def _(gu, force_scalar=0):
        return gu.new_empty((*gu.shape[:-1], gu.shape[-1] // 2))

    @torch.library.register_fake("dualserve::rotary")
    def _(positions, inv_freq):
        shape = (positions.shape[0], 2 * inv_freq.shape[0])
        return inv_freq.new_empty(shape), inv_freq.new_empty(shape)


def pointwise(x: torch.Tensor) -> bool:
    """Whether the model's norms, SwiGLU and rotary angles run as the project's ops
    (``pointwise.cpp``) for an activation like ``x``: fp32 on the CPU, with the kernels built, and no
    gradient wanted (the ops have no backward; training takes PyTorch's). Then an eager step and
    every compiled graph compute them with the same bits."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or torch.is_grad_enabled():
        return False
    return bool(_loaded) if torch.compiler.is_compiling() else available()


# ---- the packed layout (dot8.cpp's header) ----------------------------------------

def pack(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (out, in): 0..15 (bits 4, w = d q + m) or -127..127 (bits 8, w = d q), in groups of
    32 along the input with scales/mins (out, in // 32). Returns the kernel's (q, d, m)."""
    out, inp = q.shape
    if inp % GROUP:
        raise ValueError(f"dot8 needs an input width divisible by {GROUP}, not {inp}")
    tiles, groups = -(-out // TILE), inp // GROUP
    pad = tiles * TILE - out
    q = q.to(torch.int16)
    if bits == 8:
        q = q + 128
        mins = torch.zeros_like(scales) if mins is None else mins
    q = torch.nn.functional.pad(q, (0, 0, 0, pad)).view(tiles, TILE, groups, GROUP)
    if bits == 4:
        # chunk j: lane c byte b = q[c, 8j + b] | q[c, 8j + 4 + b] << 4
        g = q.view(tiles, TILE, groups, 4, 2, 4)
        packed = (g[..., 0, :] | (g[..., 1, :] << 4))                  # (tiles, 16, groups, 4, 4)
    else:
        packed = q.view(tiles, TILE, groups, 8, 4)                        # chunk j: k = 4j..4j+3
    packed = packed.permute(0, 2, 3, 1, 4).contiguous().to(torch.uint8)  # (tiles, groups, chunk, 16, 4)

    def per_tile(v: torch.Tensor) -> torch.Tensor:
        v = torch.nn.functional.pad(v.float(), (0, 0, 0, pad)).view(tiles, TILE, groups)
        return v.permute(0, 2, 1).contiguous().half()
    return packed.flatten(), per_tile(scales), per_tile(mins)


def reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
              bits: int, digits: int = 1) -> torch.Tensor:
    """What ``dot8_linear`` computes, in float64 from the unpacked weight (for tests)."""
    rest = x.float().view(x.shape[0], -1, GROUP)
    d = scales.half().double()
    m = (torch.zeros_like(scales) if mins is None else mins).half().double()
    qg = q.double().view(q.shape[0], -1, GROUP)
    total = 0
    for _ in range(digits):
        sx = rest.abs().amax(-1) / 127
        a = torch.where(sx[..., None] > 0, torch.round(rest / sx[..., None]), torch.zeros_like(rest))
        rest = rest - a * sx[..., None]
        a = a.double()
        dot = torch.einsum("rgk,ngk->rng", a, qg)
        y = dot * d[None] + (m[None] * a.sum(-1)[:, None, :] if bits == 4 else 0)
        total = total + (y * sx.double()[:, None, :]).sum(-1)
    return total


def unpack_integers(packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor, out: int, inp: int, bits: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pack`` inverted, exactly: q (out, in) as packed (0..15, or -127..127 for bits 8), and the
    scales and minimums (out, in // 32) as the fp16 values the kernel reads, in fp32."""
    tiles, groups = -(-out // TILE), inp // GROUP
    b = packed.view(tiles, groups, -1, TILE, 4).to(torch.int16)
    if bits == 4:
        q = torch.stack([b & 0x0F, b >> 4], dim=3)                 # (tiles, groups, chunk, 2, 16, 4)
        q = q.permute(0, 4, 1, 2, 3, 5).reshape(tiles * TILE, inp)
    else:
        q = b.permute(0, 3, 1, 2, 4).reshape(tiles * TILE, inp) - 128
    scale = d.float().permute(0, 2, 1).reshape(tiles * TILE, groups)
    low = m.float().permute(0, 2, 1).reshape(tiles * TILE, groups)
    return q[:out], scale[:out], low[:out]


def unpack(packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor, out: int, inp: int, bits: int) -> torch.Tensor:
    """The float weight (out, in) a packed layer stands for (``pack`` inverted)."""
    q, scale, low = unpack_integers(packed, d, m, out, inp, bits)
    w = q.float().view(out, -1, GROUP) * scale[..., None] + (low[..., None] if bits == 4 else 0)
    return w.view(out, inp)
