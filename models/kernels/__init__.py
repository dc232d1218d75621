"""The project's own CPU kernels: ``dualserve::dot8_linear`` (``dot8.cpp``),
``dualserve::attend_rows`` (``attend.cpp``, paged attention for every query length: each query
row over its visible keys alone, so decode, verify and prefill agree bit for bit), and the
transformer's norms, SwiGLU and rotary angles (``pointwise.cpp``), so that eager steps and compiled
graphs compute them with the same bits; and ``dualserve::store_kv`` (``kv_store.cpp``), a step's new
keys and values copied into the KV pool in one pass.

PyTorch's weight-only kernels widen every weight to a float and multiply in
floats: at one token they stream the weights as fast as memory allows, but each
more token costs another pass of float work, so eight tokens (an EAGLE verify, a
diffusion block) cost 2.4x one on a 2-core AVX-512 host. ``dot8`` multiplies the
way llama.cpp does: activations are quantized per row to int8 groups of 32, each
group's dot product with the 4-, 5-, 6- or 8-bit weight group (packed by ``layout.py``)
is an exact integer sum (AVX512-VNNI ``vpdpbusd``: 64 multiply-adds per instruction), and a weight group
is unpacked once for up to eight rows. Integer sums are exact, so a row's result
does not depend on how many rows came with it, on the thread count, or on which
code path (AVX512-VNNI, AVX2, plain C) the host runs.

The sources are compiled at first use with the host's C++ compiler (about 36 s on 2 cores, the
sources side by side) into ``<cache>/kernels/`` under a name that hashes the sources, the compiler,
the torch build and the flags, and loaded with ``torch.ops.load_library``. Without a compiler (or with
``DUALSERVE_NO_KERNELS=1``, or after ``disable()``) the kernels are reported unavailable: the
formats that need them are not offered and attention keeps inductor's loops.
A compiled step package calls the ops through C entry points that the same library defines
(``c_shims.py``), so the library is loaded into the global namespace.
The code path is chosen at run time from the CPU's flags, never at compile time,
so one build serves every CPU; ``describe()`` says which, in one line for a start-up log.
"""

from __future__ import annotations

try:
    import fcntl  # the build lock; a platform without it builds without one
except ImportError:  # pragma: no cover - Windows
    fcntl = None
import ctypes
import functools
import hashlib
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .layout import (GROUP, MAX_MULTIPLIED, TILE, multiplied_bound, narrowest_bits, offset,  # noqa: F401
                     pack, pack_multipliers, unpack, value_range)

# Longest compile first (``_compile_and_link``): dot8's tables of tile functions, one source a code path.
SOURCES = tuple(Path(__file__).with_name(n) for n in (
    "dot8_avx512.cpp", "dot8_amx.cpp", "dot8_avx2.cpp", "attend.cpp", "dot8.cpp", "dot8_scalar.cpp",
    "pointwise.cpp", "kv_store.cpp"))
HEADERS = tuple(Path(__file__).with_name(n) for n in ("exp.h", "dot8.h", "dot8_tiles.h", "dot8_tiles56.h", "dot8_acts.h", "dot8_amx.h", "c_shim.h"))
_loaded: bool | None = None
_error: str | None = None
_build_seconds: float | None = None  # set when this process compiled the library (else it was cached)


def _cache_dir() -> Path:
    from ..hub import default_cache_dir
    return default_cache_dir() / "kernels"


def _flags() -> list[str]:
    """Every flag of the build: each source's compile, then the link (``build``)."""
    return [*_compile_flags(), *_link_flags()]


def _compile_flags() -> list[str]:
    from torch.utils.cpp_extension import include_paths
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    inc = [f"-I{p}" for p in include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    return ["-O3", "-std=c++17", "-fPIC", "-fopenmp", "-ffp-contract=off", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *inc]


def _link_flags() -> list[str]:
    from torch.utils.cpp_extension import library_paths
    lib = library_paths()[0]
    return ["-shared", "-fopenmp", f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch_cpu"]


def _compiler() -> str:
    return os.environ.get("CXX", "g++")


@functools.cache  # the compiler does not change within a process
def _compiler_version() -> str:
    try:
        return subprocess.run([_compiler(), "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise RuntimeError(f"no C++ compiler ({_compiler()}): {e}") from e


# dot8's code paths, each built only for a CPU that can run it (``_omitted``), by torch's reading
# of the CPU (as the host key reads it: ``formats.host_key``). The plain C path is always built.
PATH_SOURCES = {
    "dot8_avx2.cpp": lambda: torch.cpu._is_avx2_supported(),
    "dot8_avx512.cpp": lambda: torch.cpu._is_avx512_supported() and torch.cpu._is_vnni_supported(),
    "dot8_amx.cpp": lambda: (torch.cpu._is_avx512_supported() and torch.cpu._is_vnni_supported()
                             and torch.cpu._is_amx_tile_supported()),
}


@functools.cache  # the CPU does not change within a process
def _omitted() -> frozenset[str]:
    """The code paths' sources this CPU cannot run: compiled empty (``-DDOT8_OMIT``, a table that
    is null), so a first start does not build them. The AMX path took 17 of the kernels' 76 s of
    compiling on a 2-core AMD EPYC without AMX, the AVX-512 path 18. dot8 still checks the CPU's
    flags when it picks a path among those built."""
    return frozenset(name for name, runs in PATH_SOURCES.items() if not runs())


@functools.cache  # the sources and the compiler do not change within a process
def library_path() -> Path:
    """Where this source, compiler, torch build and CPU's library lives (built or not)."""
    version = _compiler_version()
    texts = [s.read_text() for s in SOURCES + HEADERS]
    keyed = [*texts, version, torch.__version__, sys.version, " ".join(_keyed(_flags())), " ".join(sorted(_omitted()))]
    key = hashlib.sha256("\n".join(keyed).encode()).hexdigest()[:16]
    return _cache_dir() / f"dualserve-kernels-{key}.so"


def _keyed(flags: list[str]) -> list[str]:
    """The flags that change what is built: not where this environment keeps torch's and Python's
    headers and libraries (the versions above name those). Two environments of one torch sharing
    a cache named the library apart by their paths alone, and their starts took turns changing the
    host key: each deciding the weight format again and building every graph anew."""
    return [f for f in flags if not f.startswith(("-I", "-L", "-Wl,-rpath,"))]


def build() -> Path:
    """Compile the kernel if this machine has not yet (one process at a time, atomically)."""
    global _build_seconds
    so = library_path()
    if so.exists():
        return so
    so.parent.mkdir(parents=True, exist_ok=True)
    with open(so.with_suffix(".lock"), "w") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        if not so.exists():
            start = time.monotonic()
            with tempfile.TemporaryDirectory(prefix=f".build-{os.getpid()}-", dir=so.parent) as work:
                tmp = Path(work) / so.name
                _compile_and_link(Path(work), tmp)
                tmp.rename(so)
            _build_seconds = time.monotonic() - start
    return so


def _compile_and_link(work: Path, out: Path) -> None:
    """Each source compiled to an object in ``work``, as many at a time as there are cores (dot8.cpp
    alone takes 36 of the 51 s one compiler took for all four on a 2-core Xeon: it starts first),
    then linked into ``out``."""
    objects = [work / f"{source.stem}.o" for source in SOURCES]
    omitted = _omitted()
    with ThreadPoolExecutor(max_workers=max(1, min(len(SOURCES), os.cpu_count() or 1))) as pool:
        list(pool.map(_run, ([_compiler(), "-c", str(source), "-o", str(obj), *_compile_flags(),
                              *(["-DDOT8_OMIT"] if source.name in omitted else [])]
                             for source, obj in zip(SOURCES, objects))))
    _run([_compiler(), *map(str, objects), "-o", str(out), *_link_flags()])


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        first = next((line for line in done.stderr.splitlines() if "error" in line), "")
        raise RuntimeError(f"building the kernels failed: {first.strip()}\n{done.stderr[-4000:]}")


def available() -> bool:
    """Whether ``torch.ops.dualserve.dot8_linear`` can run here (built and loaded on first call)."""
    global _loaded, _error
    if _loaded is None and os.environ.get("DUALSERVE_NO_KERNELS"):
        _loaded, _error = False, "DUALSERVE_NO_KERNELS is set"
    if _loaded is None:
        try:
            if not hasattr(torch.ops.dualserve, "dot8_linear"):
                so = str(build())
                # Global: a compiled package calls the ops' C entry points by name (c_shims.py).
                ctypes.CDLL(so, mode=os.RTLD_GLOBAL)
                torch.ops.load_library(so)
                _register_fake()
            _loaded = True
        except (RuntimeError, OSError) as e:
            _loaded, _error = False, str(e)
    return _loaded


def disable(reason: str) -> None:
    """Report the kernels unavailable in this process, whatever the host could build: a choice made
    once at start-up, before anything asks (the CUDA-shaped profile, ``decoders/engine/compile/cuda_shaped``)."""
    global _loaded, _error
    if _loaded:
        raise RuntimeError("the kernels are loaded already: disable them before the first model loads")
    _loaded, _error = False, reason


def unavailable_reason() -> str | None:
    available()
    return _error


def code_path() -> str:
    """The instruction set the kernel runs with on this CPU: avx512_vnni, avx2 or scalar (AMX tiles
    join avx512_vnni from ``amx_from()`` rows)."""
    if not available():
        raise RuntimeError(_error)
    return torch.ops.dualserve.dot8_path()


def amx_from() -> int:
    """The fewest quantized rows (rows x digits) from which dot8 uses AMX tiles here (0: never)."""
    if not available():
        raise RuntimeError(_error)
    return int(torch.ops.dualserve.dot8_amx_from())


def describe() -> str:
    """One line for a start-up log: the kernels and the dot8 code path in use, or why there are none."""
    if not available():
        reason = str(_error).splitlines()[0][:200] if _error else "unknown"
        return f"kernels unavailable: {reason}; w4a8/w4a16 not offered, attention uses SDPA"
    first = _compiler_version().splitlines()[0] if _compiler_version() else _compiler()
    version = re.search(r"(\d+\.\d+)(\.\d+)*\s*$", first)
    compiler = Path(_compiler()).name + (f" {version.group(1)}" if version else "")
    how = "cached" if _build_seconds is None else f"compiled now, {_build_seconds:.0f} s"
    amx = f" + amx from {amx_from()} rows" if amx_from() else ""
    return f"dot8 {code_path()}{amx}, attend_rows, pointwise; built by {compiler} ({how})"


def _register_fake() -> None:
    @torch.library.register_fake("dualserve::dot8_linear")
    def _(x, q, d, m, n, bits, force_scalar=0, digits=1, s=None, mn=None, minimum=False):
        return x.new_empty((x.shape[0], n), dtype=torch.float32)

    @torch.library.register_fake("dualserve::dot8_lora")
    def _(x, q, d, m, n, bits, qa, da, ma, rank, qb, db, mb, force_scalar=0, digits=1, s=None, mn=None,
          minimum=False):
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


# ---- for tests: what the kernel computes --------------------------------------------

def reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
              bits: int, digits: int = 1, scale_mult: torch.Tensor | None = None,
              zero_mult: torch.Tensor | None = None) -> torch.Tensor:
    """What ``dot8_linear`` computes, in float64 from the unpacked weight (for tests): per group
    ``sx * (d * (s_lo dot_lo + s_hi dot_hi) + m * mn * asum)`` (s, mn 1 without multipliers; m 0
    without mins), the activations ``x ~ a sx`` with ``a`` one int8 digit, or with two digits the
    integer ``16 a0 + a1`` and ``sx`` the second digit's scale, the first's / 16."""
    if digits not in (1, 2):
        raise ValueError("digits must be 1 or 2")
    xg = x.float().view(x.shape[0], -1, GROUP)
    sx = xg.abs().amax(-1) / 127
    a = torch.where(sx[..., None] > 0, torch.round(xg / sx[..., None]), torch.zeros_like(xg))
    if digits == 2:
        rest = xg - a * sx[..., None]
        sx = sx / 16
        a = 16 * a + torch.where(sx[..., None] > 0, torch.round(rest / sx[..., None]), torch.zeros_like(rest))
    a = a.double()
    d = scales.half().double()
    m = (torch.zeros_like(scales) if mins is None else mins).half().double()
    qg = q.double().view(q.shape[0], -1, 2, GROUP // 2)
    s = torch.ones(*d.shape, 2, dtype=torch.float64) if scale_mult is None else scale_mult.double()
    mn = torch.ones_like(d) if zero_mult is None else zero_mult.double()
    dot = (torch.einsum("rghk,nghk->rngh", a.view(*a.shape[:2], 2, -1), qg) * s[None]).sum(-1)
    y = dot * d[None] + m[None] * mn[None] * a.sum(-1)[:, None, :]
    return (y * sx.double()[:, None, :]).sum(-1)
