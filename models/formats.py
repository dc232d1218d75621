"""Choosing the weight format for this host, once: from its CPU, or by measuring it.

CPUs differ: the bf16 and int8 units of AVX512-BF16 and AMX make the weight-only
kernels fast where AVX2 alone may favour plain fp32. So at start-up (``--quantization
auto``) the linear shapes of the model being loaded are timed in each format, for
one token (decode) and eight (EAGLE verify, diffusion blocks, prefill). Where the CPU
does not settle it (below), the fastest decode format wins. The table is cached per host
and model shape under the model cache, so only the first quiet start pays the second or
two it takes.

The estimate is the sum of the GEMMs of one forward (every layer's projections
plus the output head), timed with random weights of the right shapes; attention
and elementwise work are the same in every format and are left out.

A timing taken while another process holds a core is not the host's speed: an
OpenMP team whose worker is descheduled waits at each barrier, and on a 2-core
host a table measured beside a busy process read int4 at 239 ms and bf16 at 489 ms
for one token (4 ms per GEMM, a scheduler time slice) against 3.9 ms for int8,
which picked int8 over the file's int4 and made every multi-token forward look 3.7x
dearer than one. So the formats are timed in rounds, every format and token count
once per round, and each cell keeps its fastest round: a neighbour's burst hits
every format alike and the quiet rounds win. The cores other processes used
meanwhile are recorded (``models.host``); a table measured while they used more
than ``QUIET_CORES`` serves the start that measured it but is not cached, and its
choice keeps the checkpoint's own format.

``w4a16`` (int4 weight groups times activation groups in two int8 digits, ``models.kernels``) is
a candidate where the project's kernel builds; its integer sums keep one token's cost near memory
speed and let eight tokens share each weight group's unpacking. ``w4a8`` (one digit, as llama.cpp
multiplies) is faster by a row of integer work per token but answers measurably worse than the
same weights in float, and worse than llama.cpp on the same file (``clients/eval_fidelity``,
docs/numerics.md), so ``auto`` never picks it: a format is a candidate only if it is at least as
faithful as llama.cpp's (``FAITHFUL``). ``--quantization w4a8`` still serves it.

One format serves every token count: the lossless decoders (``ar`` and EAGLE's
verify) must run the same numerics, so the multi-token column is reported, not
used to pick a second copy of the weights.

**Decided once per host, and kept** (``decide``). The format changes the loaded model, its
answers at temperature 0 and every compiled graph's package key, so it must not follow one
start's noise: a first start beside a busy compiler that kept ``int4`` and a quiet second start
that switched to ``w4a16`` served different answers and built every graph twice. So the first
start decides and records its decision (``<cache>/host/format-choices.json``, by model shape and
checkpoint format, with the host key it was made under), and every later start on the same host
key serves the recorded one without deciding again. The first decision comes from:

- the CPU, where the dot8 kernel runs a vector path (``W4A16_PATHS``: AVX512-VNNI or AVX2):
  ``w4a16``, measured or not;
- else a quiet table: the fastest faithful format (``choose``);
- else (a busy table) the checkpoint's own format, exact to the file.

A changed host key (another thread count, torch, or build of the project's kernels) decides
again, and the change, or that the format stayed, is logged with the key's parts that changed; so
does a record that a table decided where the CPU now decides (an AVX2 host's record from before
AVX2 joined ``W4A16_PATHS``);
``--quantization`` given explicitly is logged where it differs from the recorded choice. The
table itself still serves the costs the router and the draft budget are fitted to: it is
measured until a quiet one is cached.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Literal

import torch
import torch.nn.functional as F

from .config import ModelConfig
from .errors import InputError
from .host import NeighbourLoad
from .quant import DOT8_DIGITS, Quantization, float_to_linear, head_linear

Candidate = Literal["fp32", "bf16", "int8", "int4", "w4a8", "w4a16"]
CANDIDATES: tuple[Candidate, ...] = ("fp32", "bf16", "int8", "int4", "w4a8", "w4a16")
# What --quantization auto may pick: the formats whose mean KL divergence and top-1 agreement against
# the float reference are clearly at least as good as llama.cpp's on the same GGUF, measured by
# clients/eval_fidelity (docs/numerics.md). int8 (per-channel weights re-quantized from the file) is
# not: KL 0.0057 against llama.cpp's 0.0034 on the default model; w4a8 is level with llama.cpp
# within the standard error, and flips answers on near ties where w4a16 does not.
FAITHFUL: tuple[Candidate, ...] = ("fp32", "bf16", "int4", "w4a16")
TOKENS = (1, 8)
# The checkpoint's own format is kept unless another is this much faster: it is exact to the file.
KEEP_STORED_MARGIN = 0.9
ROUNDS = 5          # timing rounds; each cell keeps its fastest
QUIET_CORES = 0.25  # other processes' average use (cores) up to which a table is trusted and cached
TABLE_VERSION = 4   # cache entries of another version are measured again
CHOICES_FILE = "format-choices.json"  # the recorded decisions, beside the tables' formats.json
# The dot8 code paths on which w4a16 is the fastest faithful format, so the CPU decides it without a
# table: AVX512-VNNI's vpdpbusd (AMX tiles joining it from a few rows) and AVX2's maddubs pairs
# (models/kernels/dot8.cpp: pick_path, pick_amx_from). On an AVX512-VNNI host without AMX the
# default model read int4 4.2 ms and w4a8 2.2 ms for one token (docs/formats.md), and w4a16 costs
# w4a8 plus 5% (docs/kernels.md, the 1B probe); on a 2-core AVX2 host (AMD EPYC, Zen 3) w4a16 read
# 1.6x faster than int4 at one token and at eight, quiet or busy (docs/formats.md). Plain C is
# measured instead.
W4A16_PATHS = ("avx512_vnni", "avx2")


@dataclass(frozen=True)
class FormatTable:
    """Estimated GEMM milliseconds of one forward, by format and token count, on this host."""

    host: str
    ms: dict[str, dict[str, float]]   # format -> {"1": ms, "8": ms}
    neighbour_cores: float = 0.0      # cores other processes used, on average, while it was measured

    @property
    def quiet(self) -> bool:
        """Measured while the other processes left the cores (nearly) free."""
        return self.neighbour_cores <= QUIET_CORES

    def decode_ms(self, fmt: str) -> float:
        return self.ms[fmt]["1"]

    def as_rows(self) -> list[tuple[str, float, float]]:
        return [(f, v["1"], v["8"]) for f, v in self.ms.items()]


def runnable() -> tuple[Candidate, ...]:
    """The formats this host can run (all are timed, so the table shows what fidelity costs): the
    dot8 formats need the project's kernel (``models.kernels``) built."""
    from . import kernels
    return tuple(c for c in CANDIDATES if c not in DOT8_DIGITS or kernels.available())


def candidates() -> tuple[Candidate, ...]:
    """The formats ``auto`` may pick here: runnable and at least as faithful as llama.cpp's."""
    return tuple(c for c in runnable() if c in FAITHFUL)


def check_device(quantization: str, device: str) -> None:
    """Raise ``InputError`` (one line at the command line, ``errors.one_line``) where ``quantization``
    has no kernel on ``device``: the dot8 formats (w4a8, w4a16) are the project's CPU kernel
    (``models.kernels``), so off the CPU a model in them would load and then fail its first forward."""
    if quantization in DOT8_DIGITS and torch.device(device).type != "cpu":
        raise InputError(f"--quantization {quantization} runs on the CPU only (the project's dot8 kernel); "
                         f"on {device} use int4, int8, none or auto")


def off_cpu_choice(stored: Quantization, device: str) -> Quantization:
    """``auto``'s format on ``device`` where nothing is timed (off the CPU): the checkpoint's own where
    the device runs it, else int4. An int4 layer whose shape CUDA's kernel does not pack stays in the
    model's float dtype (``quant.float_to_linear``). Nothing here builds the CPU kernels."""
    if stored in DOT8_DIGITS and torch.device(device).type != "cpu":
        return "int4"
    return stored


def host_key() -> str:
    """What the measurement depends on: the CPU's kernels, the thread count, and the build of the
    project's own kernels (a changed dot8 is measured again)."""
    from . import kernels

    build = kernels.library_path().stem.rsplit("-", 1)[-1] if kernels.available() else "none"
    return f"{torch.backends.cpu.get_cpu_capability()}-amx{int(torch.cpu._is_amx_tile_supported())}-" \
           f"bf16{int(torch.cpu._is_avx512_bf16_supported())}-t{torch.get_num_threads()}-torch{torch.__version__}" \
           f"-kernels{build}"


def _shapes(config: ModelConfig) -> list[tuple[int, int, int]]:
    """(out, in, count) of every GEMM in one forward."""
    return [(o, i, config.num_layers) for o, i in config.projection_shapes.values()] + \
        [(config.vocab_size, config.hidden_size, 1)]


def _time(fn, repeats: int = 3) -> float:
    """The fastest of ``repeats`` calls, ms."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def _layer(fmt: Candidate, out: int, inp: int, head: bool):
    """One layer as the loader builds it in ``fmt`` (quant.float_to_linear / head_linear), so a width
    no kernel takes is timed in the layer it really gets."""
    w = torch.randn(out, inp) * 0.02
    if fmt == "fp32":
        return lambda x: F.linear(x, w)
    if fmt == "bf16":
        wb = w.bfloat16()
        return lambda x: F.linear(x.bfloat16(), wb)
    if head:
        return head_linear(w, fmt, torch.float32, "cpu")
    return float_to_linear(w, None, fmt, torch.float32)


@torch.inference_mode()
def measure(config: ModelConfig, rounds: int = ROUNDS) -> FormatTable:
    """Every format at every token count once per round, each cell its fastest round (module docstring)."""
    formats = runnable()
    layers = {fmt: [(_layer(fmt, o, i, o == config.vocab_size), i, c) for o, i, c in _shapes(config)]
              for fmt in formats}
    inputs = {(tokens, inp): torch.randn(tokens, inp) for tokens in TOKENS for _, inp, _ in _shapes(config)}
    for fmt in formats:  # first calls pack weights and pick kernels: not timed
        for layer, inp, _ in layers[fmt]:
            for tokens in TOKENS:
                layer(inputs[tokens, inp])
    ms = {fmt: {str(tokens): float("inf") for tokens in TOKENS} for fmt in formats}
    with NeighbourLoad() as load:
        for _ in range(rounds):
            for fmt in formats:
                for tokens in TOKENS:
                    total = sum(_time(lambda: layer(inputs[tokens, inp])) * count for layer, inp, count in layers[fmt])
                    ms[fmt][str(tokens)] = min(ms[fmt][str(tokens)], round(total, 3))
    return FormatTable(host_key(), ms, round(load.cores, 2))


def shape_key(config: ModelConfig) -> str:
    """The model shape a table or a decision belongs to: what its GEMMs are."""
    return f"{config.hidden_size}x{config.intermediate_size}x{config.num_layers}x{config.vocab_size}"


def cached_measure(config: ModelConfig, cache_dir: Path | None,
                   measure_fn: Callable[[ModelConfig], FormatTable] | None = None,
                   key: str | None = None) -> FormatTable:
    """``measure`` (or ``measure_fn``), read from / written to ``cache_dir/formats.json`` keyed by
    host (``key``, else ``host_key()``) and model shape. A table measured while other processes
    kept the cores busy is not written."""
    key = f"v{TABLE_VERSION}|{key or host_key()}|{shape_key(config)}"
    path = cache_dir / "formats.json" if cache_dir else None
    known = _read_json(path) if path else {}
    if key in known:
        return FormatTable(**known[key])
    table = (measure_fn or measure)(config)
    if path and table.quiet:
        known[key] = asdict(table)
        _write_json(path, known)
    return table


def choose(table: FormatTable, stored: Quantization) -> tuple[Quantization, Candidate]:
    """The decode format: the fastest one, unless the checkpoint's own is within the margin, or
    the table was measured on a busy host (then the checkpoint's own format: it is exact to the file).

    Returns (quantization, candidate); quantization "none" means float weights, in
    the candidate's dtype (fp32 or bf16).
    """
    best = min((f for f in candidates() if f in table.ms), key=table.decode_ms)
    own: Candidate = "fp32" if stored == "none" else stored
    if not table.quiet or (best != own and table.decode_ms(best) > KEEP_STORED_MARGIN * table.decode_ms(own)):
        best = own
    return quantization_of(best), best


def quantization_of(candidate: Candidate) -> Quantization:
    """The loader's quantization for a candidate: "none" for the float formats (in their dtype)."""
    return "none" if candidate in ("fp32", "bf16") else candidate


def kernel_path() -> str:
    """The dot8 kernel's code path on this CPU (``kernels.code_path``: read from the CPU's flags at
    run time), or "none" where the kernel does not build."""
    from . import kernels
    return kernels.code_path() if kernels.available() else "none"


# How a recorded decision was made: the CPU's dot8 path, a quiet table, or the checkpoint's own
# format because the only table was measured beside busy processes.
Basis = Literal["cpu", "measured", "checkpoint"]
BASIS_TEXT: dict[str, str] = {"cpu": "the CPU's dot8 kernel path",
                              "measured": "a quiet measurement", "checkpoint": "the checkpoint's own format "
                              "(measured while the host was busy)"}


@dataclass(frozen=True)
class FormatChoice:
    """One decision of ``auto``: the candidate, why, and the host key it was made under."""

    candidate: Candidate
    basis: Basis
    host: str

    @property
    def quantization(self) -> Quantization:
        return quantization_of(self.candidate)


@dataclass(frozen=True)
class HostProbe:
    """What deciding a format asks of this host: the dot8 kernel's code path, the table of GEMM
    costs and the host key. The server uses the real ones; tests pass their own (no timing)."""

    dot8_path: Callable[[], str] = kernel_path
    measure: Callable[[ModelConfig], FormatTable] = measure
    key: Callable[[], str] = host_key


@dataclass(frozen=True)
class Decision:
    """What ``decide`` returns: the choice served, whether it was read from the record, the one
    recorded before that this decision replaced and why (a change to log), and the cost table."""

    choice: FormatChoice
    recorded: bool                 # read from the record, nothing decided this start
    previous: FormatChoice | None  # the record this decision replaced
    table: FormatTable
    why: str = ""                  # why ``previous`` was decided again


def decide(config: ModelConfig, stored: Quantization, cache_dir: Path | None,
           probe: HostProbe = HostProbe()) -> Decision:
    """``auto``'s format for this model on this host: the recorded decision for this shape and
    checkpoint format if it was made under this host key (unless a table made it where this CPU's
    dot8 path now decides by itself: ``W4A16_PATHS`` grew), else decided now (``decide_now``) and
    recorded (module docstring). The cost table is ``cached_measure``'s either way."""
    host = probe.key()
    table = cached_measure(config, cache_dir, probe.measure, host)
    book, entry = _book(cache_dir), _entry(config, stored)
    previous = _read_choice(book, entry)
    same_key = previous is not None and previous.host == host
    if same_key and previous.basis == "cpu":
        return Decision(previous, True, None, table)  # the CPU decided: nothing to look at again
    dot8_path = probe.dot8_path()
    if same_key and dot8_path not in W4A16_PATHS:
        return Decision(previous, True, None, table)
    why = "" if previous is None else (
        f"this host's key changed ({key_change(previous.host, host)})" if previous.host != host else
        f"this CPU's dot8 path ({dot8_path}) now decides it, where {BASIS_TEXT[previous.basis]} did")
    choice = decide_now(table, stored, dot8_path, host)
    if book is not None:
        known = _read_json(book)
        raced = FormatChoice(**known[entry]) if entry in known else None
        if raced is not None and raced.host == host and raced != previous:  # a start beside this one decided first
            return Decision(raced, True, None, table)
        known[entry] = asdict(choice)
        _write_json(book, known)
    return Decision(choice, False, previous, table, why)


def decide_now(table: FormatTable, stored: Quantization, dot8_path: str, host: str) -> FormatChoice:
    """A first decision: ``w4a16`` where dot8 runs a vector path (whatever the table says, and
    however busy the host was), else ``choose`` on the table: the fastest faithful format of a
    quiet table, the checkpoint's own of a busy one."""
    if dot8_path in W4A16_PATHS:
        return FormatChoice("w4a16", "cpu", host)
    _, candidate = choose(table, stored)
    return FormatChoice(candidate, "measured" if table.quiet else "checkpoint", host)


def recorded_choice(config: ModelConfig, stored: Quantization, cache_dir: Path | None,
                    key: Callable[[], str] = host_key) -> FormatChoice | None:
    """The decision recorded for this model under this host key, if any (nothing is decided)."""
    choice = _read_choice(_book(cache_dir), _entry(config, stored))
    return choice if choice is not None and choice.host == key() else None


def _book(cache_dir: Path | None) -> Path | None:
    return cache_dir / CHOICES_FILE if cache_dir else None


def _entry(config: ModelConfig, stored: Quantization) -> str:
    """A decision's key in the record: the model's shape and the checkpoint's own format (a float
    and an int4 checkpoint of one shape may be served in different formats)."""
    return f"{shape_key(config)}|{stored}"


def _read_choice(book: Path | None, entry: str) -> FormatChoice | None:
    found = _read_json(book).get(entry) if book else None
    return FormatChoice(**found) if found else None


def _read_json(path: Path) -> dict:
    """The file's object; {} where it is absent or unreadable (written again whole by the next
    decision or table: a start never fails on its cache)."""
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def key_change(old: str, new: str) -> str:
    """The parts of a host key that differ, as "old -> new" pairs (``host_key`` joins them by "-")."""
    a, b = old.split("-"), new.split("-")
    if len(a) != len(b):
        return f"{old} -> {new}"
    return ", ".join(f"{x} -> {y}" for x, y in zip(a, b) if x != y) or "none"


def _write_json(path: Path, data: dict) -> None:
    """Written whole and renamed, so a start reading it meanwhile never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
