"""dualserve against llama.cpp's C++ ``llama-server`` on the same GGUF file, same threads, in one run.

Run as::

    python -m dualserve.clients.bench_llamacpp --threads 2 --requests 12

One command starts the servers (each on a free local port, logs in a temporary directory), or
targets running ones with ``--dualserve-url`` / ``--llamacpp-url``, and prints ours / baseline
ratios:

- single stream, for each dualserve decoder (``ar``, ``eagle``, ``diffusion``, selected per
  request with ``extra_body={"decoder": ...}``) against the same baseline. The two servers
  alternate prompt by prompt (who goes first alternates too), so noise from other work on a
  shared machine hits both alike; the baseline is measured again beside every decoder. Each
  measured request starts ``--settle`` seconds (default 1) after the previous one ended, so that
  neither server starts on cores the other has just been using: dualserve's OpenMP governor
  (``decoders/engine/openmp.py``) averages its neighbours' load over about half a second and
  keeps its threads from spinning for about a second after a neighbour's burst, and a 64-token
  request sent straight after the baseline's turn ran that whole second throttled
  (``--settle 0`` measures it that way);
- ``--settle-compare``: ``ar`` is measured both ways in one run. Each prompt goes to dualserve
  twice, each time right after a baseline request: once ``--settle`` seconds after it, once
  straight after it (which of the two comes first alternates by prompt). The report adds the
  ``ar (no settle)`` row and dualserve's no-settle / settle decode ratio (the target is 0.9 or
  more: the governor should cost a request sent into a neighbour's wake little);
- aggregate throughput at concurrency 16 (``--concurrency``) for each server, and for each server
  its c16 / c1 gain (c1: completion tokens / summed request time of its single-stream ``ar`` run);
- cold time to first token for prompts of real code of about 1k and 3k tokens (``--cold-tokens``),
  ``--cold-requests`` prompts per size and server. Each prompt (``clients/code_prompts.py``: a
  stretch of the standard library's source cut to the size with dualserve's own ``/tokenize``,
  ending "Explain what this code does.") is new to both servers, so neither finds any of it in a
  prefix cache. It goes to both, one after the other, who goes first alternating, each request
  ``--settle`` seconds after the previous one ended, as a streamed chat request (dualserve's
  ``ar`` decoder, 4 max tokens); TTFT is the time to the first text chunk. Then each server gets
  the same prompt with one line added (``warm``: its prefix cached, as when a user types one more
  line), in the same order. ``--warmup`` prompts of each size go to both servers first,
  unmeasured. The table gives the mean TTFT of each server, the prompt tokens the servers counted
  (``usage.prompt_tokens``), and the ratio baseline / ours (above 1: dualserve answers sooner;
  the target at 3k tokens is 1.5). Every baseline is given prompts of its own, as dualserve, which
  serves beside all of them, keeps the earlier ones in its prefix cache.

The baseline (``--baseline``) is ``cpp``, llama.cpp's own C++ ``llama-server`` (found or built by
``clients/llamacpp_build.py``: ``--llama-server PATH``, else ``llama-server`` on ``PATH``, else a
build into the cache), started as ``llama-server -m GGUF -t T -tb T -np 1 -c CTX`` for the single
stream (and the cold prompts: CTX is ``--ctx``, raised to the largest ``--cold-tokens`` + 256) and
again with ``-np C -c C*CTX`` for concurrency C (llama-server splits its context over its slots;
continuous batching is its default); ``python`` is llama-cpp-python's Python server, ``python -m
llama_cpp.server --model GGUF --n_threads T --n_threads_batch T --n_ctx CTX --interrupt_requests
False`` (by default it aborts a running stream when the next request arrives, which would break
the concurrency level), a weaker second row: ``--baseline cpp,python`` measures both. Every table
header and JSON record names the server its figures came from.

``--quantize Q4_0,Q4_K_M`` makes those files from the GGUF with ``llama-quantize
--allow-requantize`` (into ``<cache>/llama.cpp/quantized/``, reused on later runs) and runs the
whole comparison on each of them in turn, both servers on the same file, one report per file;
``source`` in the list is the GGUF itself (``--quantize source,Q4_0,Q4_K_M``: the default file and
both requantized ones in one run). Each dualserve server is measured once it has built or loaded
every step graph (``/status.json``), never beside its own build children.

The other requests are chat requests (one user message each) from ``prompts/bench.jsonl``,
greedy, 64 max tokens (``--max-tokens``). All are streamed through the OpenAI SDK by the load
client in ``clients/bench.py`` (same TTFT / decode tok/s definitions: decode tok/s is (tokens - 1)
/ time from the first to the last text chunk; token counts come from the servers' ``usage``). A
row's decode tok/s is pooled: all its requests' decode tokens over their decode seconds, so a short
reply whose chunks arrive together weighs what its length weighs.

Servers this command started are stopped when it exits, also on Ctrl-C or SIGTERM. Options:

- ``--dualserve-args "--quantization int4"``: extra arguments for ``dualserve serve``;
- ``--llamacpp-args "..."``: extra arguments for the baseline server(s);
- ``--gguf PATH``: the GGUF file both servers serve (default: the default model's file in the
  model cache), any Llama / Qwen GGUF such as one from ``clients/write_gguf.py``; a ``--model`` in
  ``--dualserve-args`` overrides dualserve's;
- ``--json out.json``: every request, summary and ratio, per file and baseline.

llama.cpp is not a dependency of the project. For ``--baseline python``, build llama-cpp-python
without AMX (its AMX kernels can crash on the Q4_1 file on CPUs that expose AMX)::

    CFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \\
    CXXFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \\
    CMAKE_BUILD_PARALLEL_LEVEL=1 nice -n 19 \\
    python -m pip install "llama-cpp-python[server]==0.3.36"
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Literal, Sequence

from dualserve.clients.bench import (
    DEFAULT_PROMPTS,
    WARMUP_PROMPT,
    BenchSpec,
    answered_before,
    LevelSummary,
    Prompt,
    RequestResult,
    interleave_kinds,
    level_record,
    load_prompts,
    ratios,
    resolve_model,
    run_level,
    stream_one,
    summarize_level,
)
from dualserve.clients.code_prompts import CodePrompt, TokenCounter, code_prompt, server_token_counter
from dualserve.clients.llamacpp_build import Binaries, find_binaries

DECODERS = ("ar", "eagle", "diffusion")
COLD_MAX_TOKENS = 4  # the first token is what is timed; a few more show the answer is sane
COLD_CTX_MARGIN = 256  # the chat template, the warm variant's added line and the answer, past the code
COLD_TARGET = (3000, 1.5)  # issue 54: cold 3k-token TTFT at least 1.5x llama-server's
WARM_LINE = "Keep the answer to one paragraph."
BaselineKind = Literal["cpp", "python"]
BASELINE_SERVERS: dict[BaselineKind, str] = {"cpp": "llama-server", "python": "llama-cpp-python"}


# ---------------------------------------------------------------------------------------------
# Arguments


def _comma_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="CPU threads for both servers (default: all cores)")
    p.add_argument("--gguf", type=Path, default=None,
                   help="GGUF file for both servers (default: the default model's file in the cache)")
    p.add_argument("--cache-dir", default=None,
                   help="dualserve cache (the default GGUF; llama.cpp's build and quantized files)")
    p.add_argument("--baseline", default="cpp",
                   help="comma-separated: cpp (llama.cpp's llama-server, default), python (llama-cpp-python)")
    p.add_argument("--llama-server", type=Path, default=None, help="llama-server binary (default: PATH, else build)")
    p.add_argument("--build-jobs", type=int, default=os.cpu_count() or 1, help="compile jobs if llama.cpp is built")
    p.add_argument("--ctx", type=int, default=1024,
                   help="baseline context tokens per slot (single stream: at least the largest --cold-tokens + "
                        f"{COLD_CTX_MARGIN})")
    p.add_argument("--quantize", default="",
                   help="comma-separated llama-quantize types, e.g. Q4_0,Q4_K_M; 'source' is the GGUF itself")
    p.add_argument("--dualserve-url", help="target a running dualserve (…/v1) instead of starting one")
    p.add_argument("--llamacpp-url", help="target a running baseline server (…/v1) instead of starting one")
    p.add_argument("--dualserve-args", default="", help="extra arguments for 'dualserve serve', one string")
    p.add_argument("--llamacpp-args", default="", help="extra arguments for the baseline server, one string")
    p.add_argument("--decoders", default=",".join(DECODERS),
                   help="comma-separated dualserve decoders for the single-stream rows")
    p.add_argument("--requests", type=int, default=12, help="single-stream requests per decoder (and server)")
    p.add_argument("--concurrency", type=int, default=16, help="level for the aggregate row; 0 skips it")
    p.add_argument("--settle", type=float, default=1.0,
                   help="seconds between one request's end and the next one's start (see the module docstring)")
    p.add_argument("--settle-compare", action="store_true",
                   help="measure single-stream ar both with --settle and with no pause, interleaved")
    p.add_argument("--cold-tokens", default="1000,3000",
                   help="comma-separated sizes of the cold prompts of real code, in tokens; empty skips them")
    p.add_argument("--cold-requests", type=int, default=3, help="cold prompts per size and server")
    p.add_argument("--concurrent-requests", type=int, default=None,
                   help="requests at that level (default: 2 x concurrency)")
    p.add_argument("--concurrent-decoder", default="ar", help="dualserve decoder for the aggregate row")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests per server and decoder first")
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    p.add_argument("--timeout", type=float, default=900.0, help="per-request timeout, seconds")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for a server to start")
    p.add_argument("--json", type=Path, dest="json_out", help="write every request and summary here")


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    unknown = [d for d in args.decoder_list if d not in DECODERS]
    if unknown or not args.decoder_list:
        p.error(f"--decoders: expected a comma-separated subset of {','.join(DECODERS)}, got {args.decoders!r}")
    if not args.baseline_list or any(b not in BASELINE_SERVERS for b in args.baseline_list):
        p.error(f"--baseline: expected a comma-separated subset of cpp,python, got {args.baseline!r}")
    if args.llamacpp_url and len(args.baseline_list) > 1:
        p.error("--llamacpp-url names one running server: give one --baseline with it")
    if args.quantize_list and (args.dualserve_url or args.llamacpp_url):
        p.error("--quantize starts both servers on each file it makes: drop --dualserve-url / --llamacpp-url")
    if args.settle_compare and "ar" not in args.decoder_list:
        p.error("--settle-compare measures the ar decoder: include ar in --decoders")
    if any(n < 1 for n in args.cold_sizes):
        p.error(f"--cold-tokens: sizes must be positive, got {args.cold_tokens!r}")
    for name in ("threads", "requests", "ctx", "build_jobs", "cold_requests"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.concurrency < 0:
        p.error("--concurrency must be 0 (skip) or positive")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dualserve.clients.bench_llamacpp",
                                description=__doc__.split("\n")[0])
    _add_options(p)
    args = p.parse_args(argv)
    args.decoder_list = _comma_list(args.decoders)
    args.baseline_list = _comma_list(args.baseline)
    args.quantize_list = _comma_list(args.quantize)
    try:
        args.cold_sizes = [int(x) for x in _comma_list(args.cold_tokens)]
    except ValueError:
        p.error(f"--cold-tokens: expected comma-separated integers, got {args.cold_tokens!r}")
    _check(p, args)
    if args.concurrent_requests is None:
        args.concurrent_requests = 2 * args.concurrency
    try:
        args.dualserve_argv = shlex.split(args.dualserve_args)
        args.llamacpp_argv = shlex.split(args.llamacpp_args)
    except ValueError as exc:
        p.error(f"could not split extra server arguments: {exc}")
    if args.quantize_list and names_model(args.dualserve_argv):
        p.error("--quantize serves each made file: drop --model / --ar from --dualserve-args")
    if args.gguf and not args.quantize_list and not names_model(args.dualserve_argv):
        args.dualserve_argv = ["--model", str(args.gguf), *args.dualserve_argv]
    return args


def names_model(argv: Sequence[str]) -> bool:
    return any(a.split("=")[0] in ("--model", "--ar") for a in argv)


def single_stream_ctx(args: argparse.Namespace) -> int:
    """Context of the single-stream baseline: ``--ctx``, or room for the largest cold prompt."""
    return max([args.ctx, *(size + COLD_CTX_MARGIN for size in args.cold_sizes)])


# ---------------------------------------------------------------------------------------------
# Server commands


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dualserve_command(threads: int, port: int, extra: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "dualserve.server.cli", "serve", "--threads", str(threads),
            "--host", "127.0.0.1", "--port", str(port), *extra]


def dualserve_extra(args: argparse.Namespace, gguf: Path | None) -> list[str]:
    """``--dualserve-args``, with ``--model GGUF`` first when a file is named and they name none."""
    if gguf is None or names_model(args.dualserve_argv):
        return list(args.dualserve_argv)
    return ["--model", str(gguf), *args.dualserve_argv]


def llama_server_command(server: Path, gguf: Path, threads: int, port: int, slots: int, ctx: int,
                         extra: Sequence[str] = ()) -> list[str]:
    """llama-server with ``slots`` parallel sequences; it splits ``-c`` over them, so ``ctx`` a slot."""
    return [str(server), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-np", str(slots),
            "--port", str(port), "--host", "127.0.0.1", "-c", str(ctx * slots), *extra]


def llama_cpp_python_command(gguf: Path, threads: int, port: int, ctx: int, extra: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf),
            "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(ctx),
            "--host", "127.0.0.1", "--port", str(port), "--interrupt_requests", "False", *extra]


# ---------------------------------------------------------------------------------------------
# Server processes


@dataclass
class Server:
    """A server process this command started (own session, so its whole group can be stopped)."""

    name: str
    url: str
    proc: subprocess.Popen
    log_path: Path
    ready_url: str = ""  # answers 200 once the model is loaded; the url's /models when empty

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def start_server(name: str, cmd: Sequence[str], port: int, log_dir: Path, ready_path: str = "/v1/models") -> Server:
    log_path = log_dir / f"{name}.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    root = f"http://127.0.0.1:{port}"
    return Server(name, f"{root}/v1", proc, log_path, root + ready_path)


def wait_ready(server: Server, timeout: float) -> None:
    """Poll the server's ready URL until it answers 200; fail early if the process exits."""
    ready = server.ready_url or server.url + "/models"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited with code {server.proc.returncode} while starting; "
                               f"log {server.log_path}:\n{server.log_tail()}")
        try:
            with urllib.request.urlopen(ready, timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass  # not listening yet, or llama-server's 503 while it loads the model
        time.sleep(0.5)
    raise RuntimeError(f"{server.name} did not answer {ready} within {timeout:.0f}s; "
                       f"log {server.log_path}:\n{server.log_tail()}")


@contextlib.contextmanager
def running(name: str, cmd: Sequence[str], port: int, log_dir: Path, timeout: float,
            ready_path: str = "/v1/models") -> Iterator[str]:
    """Start a server, wait until it is ready, yield its …/v1 URL; stop it on exit."""
    server = start_server(name, cmd, port, log_dir, ready_path)
    try:
        print(f"starting {name}: {shlex.join(cmd)}  (log {server.log_path})", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        wait_ready(server, timeout)
        print(f"{name} ready in {time.monotonic() - t0:.1f}s at {server.url}", file=sys.stderr, flush=True)
        yield server.url
    finally:
        server.stop()


@dataclass(frozen=True)
class Baseline:
    """One baseline server to compare against: a running one (``url``) or one this command starts."""

    kind: BaselineKind
    gguf: Path | None
    binaries: Binaries | None = None  # for kind "cpp", set by main from clients/llamacpp_build.py
    url: str | None = None

    @property
    def server(self) -> str:
        return BASELINE_SERVERS[self.kind]

    def command(self, args: argparse.Namespace, port: int, slots: int, ctx: int) -> list[str]:
        """The start command for ``slots`` parallel requests of ``ctx`` tokens each."""
        assert self.gguf is not None
        if self.kind == "cpp":
            assert self.binaries is not None
            return llama_server_command(self.binaries.server, self.gguf, args.threads, port, slots, ctx,
                                        args.llamacpp_argv)
        return llama_cpp_python_command(self.gguf, args.threads, port, ctx, args.llamacpp_argv)


@contextlib.contextmanager
def baseline_server(b: Baseline, args: argparse.Namespace, slots: int, ctx: int, log_dir: Path,
                    commands: list[list[str]] | None = None) -> Iterator[str]:
    """The baseline's …/v1 URL, started for ``slots`` parallel requests of ``ctx`` tokens unless it
    is already running (the command it was started with is appended to ``commands``)."""
    if b.url:
        yield b.url
        return
    if b.kind == "python":
        try:
            import llama_cpp  # noqa: F401  (only to fail early with a useful message)
        except ImportError:
            raise SystemExit("llama-cpp-python is not installed; see this module's docstring for how "
                             "to build it, or pass --llamacpp-url") from None
    port = free_port()
    ready = "/health" if b.kind == "cpp" else "/v1/models"
    cmd = b.command(args, port, slots, ctx)
    if commands is not None:
        commands.append(cmd)
    with running(b.server, cmd, port, log_dir, args.startup_timeout, ready) as url:
        yield url


@contextlib.contextmanager
def dualserve_server(args: argparse.Namespace, gguf: Path | None, log_dir: Path) -> Iterator[str]:
    if args.dualserve_url:
        yield args.dualserve_url
        return
    port = free_port()
    cmd = dualserve_command(args.threads, port, dualserve_extra(args, gguf))
    with running("dualserve", cmd, port, log_dir, args.startup_timeout) as url:
        wait_compiled(url, args.startup_timeout)
        yield url


def wait_compiled(url: str, timeout: float) -> None:
    """Wait until dualserve has built or loaded every step graph (``/status.json``'s ``compile``
    entry is gone): a server building graphs serves eagerly, and its build children take the
    cores both servers are measured on (llama.cpp's turns beside a build read 2-7 tok/s)."""
    root = url.rstrip("/").removesuffix("/v1")
    t0, said = time.monotonic(), None
    while time.monotonic() - t0 < timeout:
        try:
            with urllib.request.urlopen(f"{root}/status.json", timeout=10) as r:
                compiling = json.loads(r.read()).get("compile")
        except (OSError, ValueError):
            return  # no status page to read: measure as it is
        if compiling is None:
            if said is not None:
                print(f"dualserve: every step graph ready after {time.monotonic() - t0:.0f}s", file=sys.stderr,
                      flush=True)
            return
        if said != compiling["built"]:
            said = compiling["built"]
            print(f"dualserve: building step graphs ({said} of {compiling['total']} ready); waiting",
                  file=sys.stderr, flush=True)
        time.sleep(2.0)
    raise SystemExit(f"dualserve still building step graphs after {timeout:.0f}s")


def default_gguf(cache_dir: str | None) -> Path:
    from dualserve.models.hub import default_cache_dir, default_gguf_path

    return default_gguf_path(default_cache_dir(cache_dir))


def _raise_keyboard_interrupt(signum, frame):  # SIGTERM: unwind like Ctrl-C so servers are stopped
    raise KeyboardInterrupt


# ---------------------------------------------------------------------------------------------
# Quantized variants


def quantized_path(cache_dir: Path, gguf: Path, qtype: str) -> Path:
    """Where ``gguf`` quantized to ``qtype`` is kept; the name carries the source file's identity
    (path, size, mtime), so a changed or different source of the same name is quantized anew."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:8]
    return cache_dir / "llama.cpp" / "quantized" / f"{gguf.stem}-{key}.{qtype}.gguf"


def quantize_command(quantize: Path, src: Path, dst: Path, qtype: str, threads: int) -> list[str]:
    return [str(quantize), "--allow-requantize", str(src), str(dst), qtype, str(threads)]


def quantized_file(quantize: Path, cache_dir: Path, gguf: Path, qtype: str, threads: int, log_dir: Path) -> Path:
    """``gguf`` quantized to ``qtype``, made unless the cache has it."""
    dst = quantized_path(cache_dir, gguf, qtype)
    if dst.is_file():
        print(f"quantized {qtype}: reusing {dst}", file=sys.stderr, flush=True)
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    # Written under another name and renamed when done: a file under the final name is a whole one.
    partial = dst.with_name(dst.name + ".partial")
    cmd = quantize_command(quantize, gguf, partial, qtype, threads)
    log = log_dir / f"quantize-{qtype}.log"
    print(f"quantizing {gguf.name} to {qtype}: {shlex.join(cmd)}  (log {log})", file=sys.stderr, flush=True)
    with open(log, "wb") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
    if code:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"llama-quantize {qtype} failed with code {code}; log {log}:\n{tail}")
    partial.replace(dst)
    return dst


# ---------------------------------------------------------------------------------------------
# Measurement


@dataclass
class SideBySide:
    """One single-stream comparison: dualserve with `decoder` against a baseline, alternating."""

    decoder: str
    ours: LevelSummary
    base: LevelSummary
    ours_requests: list[RequestResult] = field(default_factory=list)
    base_requests: list[RequestResult] = field(default_factory=list)

    @property
    def ratios(self) -> dict[str, float | None]:
        return ratios(self.ours, self.base)


@dataclass
class Aggregate:
    concurrency: int
    ours: LevelSummary
    base: LevelSummary
    ours_requests: list[RequestResult] = field(default_factory=list)
    base_requests: list[RequestResult] = field(default_factory=list)


@dataclass
class ColdRow:
    """Cold prompts of one size against one baseline, and the same prompts with a line added."""

    size: int  # the token budget the prompts were cut to
    cold: SideBySide
    warm: SideBySide  # each cold prompt plus WARM_LINE, sent right after it: the prefix is cached


def ttft_gain(s: SideBySide) -> float | None:
    """Baseline TTFT / ours (means over requests): above 1, dualserve reaches the first token sooner."""
    r = s.ratios["ttft"]
    return 1.0 / r if r else None


def prompt_tokens(requests: Sequence[RequestResult]) -> float | None:
    """Mean prompt tokens the server reported (``usage.prompt_tokens``)."""
    counts = [r.prompt_tokens for r in requests if r.ok and r.prompt_tokens is not None]
    return sum(counts) / len(counts) if counts else None


@dataclass
class BaselineRun:
    """Everything measured against one baseline server on one file."""

    server: str  # "llama-server" or "llama-cpp-python"
    model: str
    single: list[SideBySide]
    aggregate: Aggregate | None
    settle_ratio: float | None = None  # dualserve ar no-settle / settle decode tok/s (--settle-compare)
    cold: list[ColdRow] = field(default_factory=list)
    url: str = ""
    commands: list[list[str]] = field(default_factory=list)  # the baseline's, where this command started it


async def timed(client, spec: BenchSpec, prompt: Prompt) -> tuple[RequestResult, float]:
    t0 = time.perf_counter()
    res = await stream_one(client, spec, prompt)
    return res, time.perf_counter() - t0


async def _warm(ours, ours_spec: BenchSpec, base, base_spec: BenchSpec, warmup: int) -> None:
    for _ in range(warmup):
        await stream_one(ours, ours_spec, WARMUP_PROMPT)
        await stream_one(base, base_spec, WARMUP_PROMPT)


def _progress(label: str, prompt: Prompt, o: RequestResult, b: RequestResult, base_name: str) -> None:
    print(f"  {label:<9} {prompt.id:<18} ours {_tps(o):>6} tok/s ({o.tokens:>3} tok)  "
          f"{base_name} {_tps(b):>6} tok/s ({b.tokens:>3} tok)", file=sys.stderr, flush=True)


async def side_by_side(ours, ours_spec: BenchSpec, base, base_spec: BenchSpec, prompts: Sequence[Prompt],
                       n: int, warmup: int, settle: float = 0.0, base_name: str = "llama.cpp") -> SideBySide:
    """n prompts, each sent to both servers one after the other, ``settle`` seconds apart; who goes
    first alternates."""
    await _warm(ours, ours_spec, base, base_spec, warmup)
    runs: dict[str, list[RequestResult]] = {"ours": [], "base": []}
    wall = {"ours": 0.0, "base": 0.0}
    sides = {"ours": (ours, ours_spec), "base": (base, base_spec)}
    for i in range(n):
        prompt = prompts[i % len(prompts)]
        for side in (("ours", "base") if i % 2 == 0 else ("base", "ours")):
            await asyncio.sleep(settle)
            res, seconds = await timed(*sides[side], prompt)
            runs[side].append(res)
            wall[side] += seconds
        _progress(ours_spec.decoder or "default", prompt, runs["ours"][-1], runs["base"][-1], base_name)
    return SideBySide(ours_spec.decoder or "default", summarize_level(1, runs["ours"], wall["ours"]),
                      summarize_level(1, runs["base"], wall["base"]), runs["ours"], runs["base"])


async def settle_compare(ours, ours_spec: BenchSpec, base, base_spec: BenchSpec, prompts: Sequence[Prompt],
                         n: int, warmup: int, settle: float, base_name: str = "llama.cpp"
                         ) -> tuple[SideBySide, SideBySide]:
    """n prompts, each sent to dualserve twice, each time right after the baseline answered it:
    once ``settle`` seconds after, once with no pause (which first alternates by prompt). Returns
    the settled and the unsettled rows; both hold all 2n baseline requests."""
    await _warm(ours, ours_spec, base, base_spec, warmup)
    runs: dict[float, list[RequestResult]] = {settle: [], 0.0: []}
    wall = {settle: 0.0, 0.0: 0.0}
    base_runs: list[RequestResult] = []
    base_wall = 0.0
    for i in range(n):
        prompt = prompts[i % len(prompts)]
        for pause in ((settle, 0.0) if i % 2 == 0 else (0.0, settle)):
            await asyncio.sleep(settle)  # the baseline always starts on settled cores
            res, seconds = await timed(base, base_spec, prompt)
            base_runs.append(res)
            base_wall += seconds
            await asyncio.sleep(pause)
            res, seconds = await timed(ours, ours_spec, prompt)
            runs[pause].append(res)
            wall[pause] += seconds
            _progress(f"{ours_spec.decoder}+{pause:g}s", prompt, res, base_runs[-1], base_name)
    base_sum = summarize_level(1, base_runs, base_wall)
    d = ours_spec.decoder or "default"
    return (SideBySide(d, summarize_level(1, runs[settle], wall[settle]), base_sum, runs[settle], base_runs),
            SideBySide(f"{d} (no settle)", summarize_level(1, runs[0.0], wall[0.0]), base_sum, runs[0.0], base_runs))


def as_prompt(p: CodePrompt) -> Prompt:
    return Prompt(p.id, "code", p.text)


def with_line(p: CodePrompt) -> Prompt:
    return Prompt(f"{p.id} +line", "code", f"{p.text}\n{WARM_LINE}")


async def cold_row(ours, ours_spec: BenchSpec, base, base_spec: BenchSpec, prompts: Sequence[CodePrompt],
                   warmup: Sequence[CodePrompt], settle: float, base_name: str = "llama.cpp") -> ColdRow:
    """Each prompt to both servers (who goes first alternates), then each with WARM_LINE added in the
    same order, every request ``settle`` seconds after the previous one ended. ``warmup`` prompts go
    to both first, unmeasured."""
    for p in warmup:
        for client, spec in ((ours, ours_spec), (base, base_spec)):
            await asyncio.sleep(settle)
            await stream_one(client, spec, as_prompt(p))
    sides = {"ours": (ours, ours_spec), "base": (base, base_spec)}
    runs: dict[tuple[str, str], list[RequestResult]] = {}
    wall: dict[tuple[str, str], float] = {}
    for i, p in enumerate(prompts):
        for kind, prompt in (("cold", as_prompt(p)), ("warm", with_line(p))):
            for side in (("ours", "base") if i % 2 == 0 else ("base", "ours")):
                await asyncio.sleep(settle)
                res, seconds = await timed(*sides[side], prompt)
                runs.setdefault((kind, side), []).append(res)
                wall[kind, side] = wall.get((kind, side), 0.0) + seconds
        _cold_progress(p, runs, base_name)

    def pair(kind: str) -> SideBySide:
        o, b = runs[kind, "ours"], runs[kind, "base"]
        return SideBySide(f"{kind} {prompts[0].size}", summarize_level(1, o, wall[kind, "ours"]),
                          summarize_level(1, b, wall[kind, "base"]), o, b)

    return ColdRow(prompts[0].size, pair("cold"), pair("warm"))


def _cold_progress(p: CodePrompt, runs: dict[tuple[str, str], list[RequestResult]], base_name: str) -> None:
    def ms(r: RequestResult) -> str:
        return "err" if not r.ok else (f"{r.ttft * 1e3:.0f}" if r.ttft is not None else "-")

    o, b, ow, bw = (runs[k][-1] for k in (("cold", "ours"), ("cold", "base"), ("warm", "ours"), ("warm", "base")))
    print(f"  cold {p.id}  ours {ms(o)} ms ({o.prompt_tokens} tok), warm {ms(ow)} ms  "
          f"{base_name} {ms(b)} ms ({b.prompt_tokens} tok), warm {ms(bw)} ms", file=sys.stderr, flush=True)


def settle_ratio(settled: SideBySide, unsettled: SideBySide) -> float | None:
    """dualserve's no-settle / settle decode tok/s (pooled over requests)."""
    a, b = _dec(unsettled.ours), _dec(settled.ours)
    return a / b if a is not None and b else None


def _tps(r: RequestResult) -> str:
    return "err" if not r.ok else (f"{r.decode_tps:.1f}" if r.decode_tps else "-")


def c1_throughput(s: SideBySide | None, side: str) -> float | None:
    if s is None:
        return None
    lv = s.ours if side == "ours" else s.base
    return lv.aggregate_tps or None


# ---------------------------------------------------------------------------------------------
# Report


def _f(x: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _ms(lv: LevelSummary) -> float | None:
    return lv.ttft.mean * 1e3 if lv.ttft else None


def _dec(lv: LevelSummary) -> float | None:
    return lv.pooled_decode_tps


def fixed_width(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    table = [list(header), *map(list, rows)]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]

    def fmt(row: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    return "\n".join([fmt(table[0]), "  ".join("-" * w for w in widths), *map(fmt, table[1:])])


def single_header(base: str) -> tuple[str, ...]:
    return ("decoder", "ok", "ours tok/s", f"{base} tok/s", "ratio", "ours TTFT ms", f"{base} TTFT ms", "TTFT ratio")


def aggregate_header(base: str) -> tuple[str, ...]:
    return ("concurrency", "ok", "ours agg tok/s", f"{base} agg tok/s", "ratio", "ours c/c1", f"{base} c/c1")


def single_rows(rows: Sequence[SideBySide]) -> list[list[str]]:
    out = []
    for s in rows:
        r = s.ratios
        out.append([s.decoder, f"{s.ours.n_ok}/{s.ours.n_requests} | {s.base.n_ok}/{s.base.n_requests}",
                    _f(_dec(s.ours)), _f(_dec(s.base)), _x(r["decode_tps"]),
                    _f(_ms(s.ours), "{:.0f}"), _f(_ms(s.base), "{:.0f}"), _x(r["ttft"])])
    return out


def cold_header(base: str) -> tuple[str, ...]:
    return ("tokens", "ok", "prompt tok", "ours TTFT ms", f"{base} TTFT ms", "ratio",
            "ours warm ms", f"{base} warm ms", "warm ratio")


def cold_rows(rows: Sequence[ColdRow]) -> list[list[str]]:
    out = []
    for row in rows:
        c, w = row.cold, row.warm
        tokens = [_f(prompt_tokens(rs), "{:.0f}") for rs in (c.ours_requests, c.base_requests)]
        out.append([str(row.size), f"{c.ours.n_ok}/{c.ours.n_requests} | {c.base.n_ok}/{c.base.n_requests}",
                    " | ".join(tokens),
                    _f(_ms(c.ours), "{:.0f}"), _f(_ms(c.base), "{:.0f}"), _x(ttft_gain(c)),
                    _f(_ms(w.ours), "{:.0f}"), _f(_ms(w.base), "{:.0f}"), _x(ttft_gain(w))])
    return out


def cold_target_line(rows: Sequence[ColdRow]) -> str | None:
    size, target = COLD_TARGET
    row = next((r for r in rows if r.size == size), None)
    if row is None:
        return None
    return f"cold {size}-token TTFT: {_x(ttft_gain(row.cold))} (target >= {target:.2f}x)"


def aggregate_row(agg: Aggregate, ours_c1: float | None, base_c1: float | None) -> list[str]:
    def div(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    o, b = agg.ours.aggregate_tps, agg.base.aggregate_tps
    return [str(agg.concurrency),
            f"{agg.ours.n_ok}/{agg.ours.n_requests} | {agg.base.n_ok}/{agg.base.n_requests}",
            _f(o), _f(b), _x(div(o, b)), _x(div(o, ours_c1)), _x(div(b, base_c1))]


def _problems(single: Sequence[SideBySide], agg: Aggregate | None, base: str,
              cold: Sequence[ColdRow] = ()) -> list[str]:
    levels = [*((f"ours {s.decoder}", s.ours) for s in single), *((f"{base} beside {s.decoder}", s.base)
                                                                 for s in single)]
    if agg:
        levels += [(f"ours c{agg.concurrency}", agg.ours), (f"{base} c{agg.concurrency}", agg.base)]
    timed_levels = [(f"{who} {s.decoder}", lv) for row in cold for s in (row.cold, row.warm)
                    for who, lv in (("ours", s.ours), (base, s.base))]
    problems = []
    for label, lv in [*levels, *timed_levels]:
        if lv.errors:
            problems.append(f"{label}: {len(lv.errors)} failed, first: {lv.errors[0]}")
        if lv.usage_missing:
            problems.append(f"{label}: {lv.usage_missing} requests without usage (tokens counted as chunks)")
    for label, lv in timed_levels:
        if lv.n_empty:
            problems.append(f"{label}: {lv.n_empty} requests streamed no text (no TTFT)")
    return problems


def format_report(title: str, single: Sequence[SideBySide], agg: Aggregate | None,
                  ours_c1: float | None = None, base_c1: float | None = None, base: str = "llama.cpp",
                  settle_ratio: float | None = None, cold: Sequence[ColdRow] = ()) -> str:
    """The printed report: single-stream table (decode tok/s, TTFT), the aggregate table and the
    cold prompt table."""
    parts = [title, "", f"single stream (decode tok/s pooled: decode tokens / decode seconds over all requests; ratio = ours / {base}; ok = ours | {base}):",
             fixed_width(single_header(base), single_rows(single))]
    if settle_ratio is not None:
        parts.append(f"dualserve ar no-settle / settle decode tok/s: {settle_ratio:.2f}x (target >= 0.90x)")
    if agg is not None:
        parts += ["", f"aggregate at concurrency {agg.concurrency} (completion tokens / wall time; "
                      "c/c1 = aggregate / single-stream ar throughput, TTFT included):",
                  fixed_width(aggregate_header(base), [aggregate_row(agg, ours_c1, base_c1)])]
    if cold:
        parts += ["", f"cold prompt TTFT (a new prompt of real code each request, streamed chat, "
                      f"max_tokens={COLD_MAX_TOKENS}; ms = mean time to the first text chunk; ratio = {base} / ours, "
                      "above 1: dualserve answers sooner; warm = the same prompt plus one line, its prefix cached; "
                      f"prompt tok = usage, ours | {base}):",
                  fixed_width(cold_header(base), cold_rows(cold))]
        if line := cold_target_line(cold):
            parts.append(line)
    if problems := _problems(single, agg, base, cold):
        parts += ["", *problems]
    return "\n".join(parts)


def baseline_record(run: BaselineRun) -> dict:
    """JSON for one baseline: which server, and every single-stream and aggregate figure against it."""
    record: dict = {
        "server": run.server, "url": run.url, "model": run.model,
        "commands": run.commands,
        "single_stream": [
            {"decoder": s.decoder, "ratios": s.ratios,
             "ours": level_record(s.ours, s.ours_requests), "baseline": level_record(s.base, s.base_requests)}
            for s in run.single],
    }
    if run.settle_ratio is not None:
        record["settle_ratio"] = run.settle_ratio
    if run.cold:
        record["cold_ttft"] = [cold_record(row) for row in run.cold]
    agg = run.aggregate
    if agg is not None:
        ar_row = next((s for s in run.single if s.decoder == "ar"), None)
        ours_c1, base_c1 = c1_throughput(ar_row, "ours"), c1_throughput(ar_row, "base")
        record["aggregate"] = {
            "concurrency": agg.concurrency,
            "ours": level_record(agg.ours, agg.ours_requests), "baseline": level_record(agg.base, agg.base_requests),
            "ratio": agg.ours.aggregate_tps / agg.base.aggregate_tps if agg.base.aggregate_tps else None,
            "ours_over_c1": agg.ours.aggregate_tps / ours_c1 if ours_c1 else None,
            "baseline_over_c1": agg.base.aggregate_tps / base_c1 if base_c1 else None,
        }
    return record


def cold_record(row: ColdRow) -> dict:
    """JSON for one cold prompt size: its ratios, prompt tokens and every request, cold and warm."""
    c, w = row.cold, row.warm
    return {"size": row.size, "max_tokens": COLD_MAX_TOKENS, "ratio": ttft_gain(c), "warm_ratio": ttft_gain(w),
            "prompt_tokens": {"ours": prompt_tokens(c.ours_requests), "baseline": prompt_tokens(c.base_requests)},
            "ours": level_record(c.ours, c.ours_requests), "baseline": level_record(c.base, c.base_requests),
            "ours_warm": level_record(w.ours, w.ours_requests),
            "baseline_warm": level_record(w.base, w.base_requests)}


# ---------------------------------------------------------------------------------------------
# Main


def _spec(args: argparse.Namespace, model: str, decoder: str | None) -> BenchSpec:
    return BenchSpec(model=model, endpoint="chat", max_tokens=args.max_tokens, temperature=args.temperature,
                     decoder=decoder)


async def measure_single(args: argparse.Namespace, ours, ours_model: str, base, base_spec: BenchSpec,
                         server: str) -> tuple[list[SideBySide], float | None]:
    """The single-stream rows against one baseline, and the settle ratio where asked for."""
    prompts = interleave_kinds(load_prompts(args.prompts))
    single: list[SideBySide] = []
    ratio = None
    for d in args.decoder_list:
        print(f"single stream: dualserve decoder={d} vs {server}, {args.requests} prompts", file=sys.stderr)
        if d == "ar" and args.settle_compare:
            settled, unsettled = await settle_compare(ours, _spec(args, ours_model, d), base, base_spec, prompts,
                                                      args.requests, args.warmup, args.settle, server)
            single += [settled, unsettled]
            ratio = settle_ratio(settled, unsettled)
        else:
            single.append(await side_by_side(ours, _spec(args, ours_model, d), base, base_spec, prompts,
                                             args.requests, args.warmup, args.settle, server))
    return single, ratio


async def measure_aggregate(args: argparse.Namespace, ours, ours_model: str, base, base_spec: BenchSpec
                            ) -> Aggregate:
    prompts = interleave_kinds(load_prompts(args.prompts))
    c, n = args.concurrency, args.concurrent_requests
    print(f"aggregate: concurrency {c}, {n} requests per server", file=sys.stderr, flush=True)
    b_sum, b_res = await run_level(base, base_spec, prompts, c, n)
    await asyncio.sleep(args.settle)
    o_sum, o_res = await run_level(ours, _spec(args, ours_model, args.concurrent_decoder), prompts, c, n)
    return Aggregate(c, o_sum, b_sum, o_res, b_res)


async def measure_cold(args: argparse.Namespace, ours, ours_model: str, base, base_model: str, server: str,
                       count_tokens: TokenCounter, baseline_index: int) -> list[ColdRow]:
    """The cold prompt rows against one baseline. The baseline numbered ``baseline_index`` in
    ``--baseline`` gets prompts of its own, new to dualserve too."""
    per = args.warmup + args.cold_requests
    ours_spec = BenchSpec(ours_model, "chat", COLD_MAX_TOKENS, args.temperature, "ar")
    base_spec = BenchSpec(base_model, "chat", COLD_MAX_TOKENS, args.temperature, None)
    rows = []
    for size in args.cold_sizes:
        print(f"cold prompts: {args.cold_requests} of about {size} tokens of code per server (and {args.warmup} "
              f"unmeasured) vs {server}", file=sys.stderr, flush=True)
        prompts = [code_prompt(size, baseline_index * per + i, count_tokens) for i in range(per)]
        rows.append(await cold_row(ours, ours_spec, base, base_spec, prompts[args.warmup:], prompts[:args.warmup],
                                   args.settle, server))
    return rows


async def against_baseline(args: argparse.Namespace, ours, ours_model: str, b: Baseline, log_dir: Path,
                           count_tokens: TokenCounter, baseline_index: int = 0) -> BaselineRun:
    """Single stream and the cold prompts against the baseline started for one slot, then the
    aggregate against it restarted for ``--concurrency`` slots."""
    from openai import AsyncOpenAI

    def client(url: str) -> AsyncOpenAI:
        return AsyncOpenAI(base_url=url, api_key="EMPTY", timeout=args.timeout, max_retries=0)

    commands: list[list[str]] = []
    with baseline_server(b, args, 1, single_stream_ctx(args), log_dir, commands) as url:
        async with client(url) as base:
            base_model = await resolve_model(base, None)
            single, ratio = await measure_single(args, ours, ours_model, base, _spec(args, base_model, None),
                                                 b.server)
            cold = await measure_cold(args, ours, ours_model, base, base_model, b.server, count_tokens,
                                      baseline_index)
    agg = None
    if args.concurrency:
        with baseline_server(b, args, args.concurrency, args.ctx, log_dir, commands) as agg_url:
            async with client(agg_url) as base:
                agg = await measure_aggregate(args, ours, ours_model, base, _spec(args, base_model, None))
    return BaselineRun(b.server, base_model, single, agg, ratio, cold, url, commands)


def _title(args: argparse.Namespace, ours_model: str, run: BaselineRun, gguf: Path | None) -> str:
    return (f"dualserve ({ours_model}) vs {run.server} ({Path(run.model).name}) · "
            f"file {gguf.name if gguf else '-'} · threads={args.threads} · chat · max_tokens={args.max_tokens} · "
            f"temperature={args.temperature} · settle={args.settle:g} s"
            + (f" · dualserve args: {args.dualserve_args}" if args.dualserve_args else ""))


async def run_bench(args: argparse.Namespace, ours_url: str, baselines: Sequence[Baseline],
                    log_dir: Path | None = None, gguf: Path | None = None) -> dict:
    """Every comparison on one file: print one report per baseline; return the file's JSON record."""
    from openai import AsyncOpenAI

    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="bench_llamacpp_"))
    ours = AsyncOpenAI(base_url=ours_url, api_key="EMPTY", timeout=args.timeout, max_retries=0)
    records = []
    async with ours:
        ours_model = await resolve_model(ours, None)
        for i, b in enumerate(baselines):
            run = await against_baseline(args, ours, ours_model, b, log_dir, server_token_counter(ours_url), i)
            ar_row = next((s for s in run.single if s.decoder == args.concurrent_decoder), None)
            print(format_report(_title(args, ours_model, run, gguf), run.single, run.aggregate,
                                c1_throughput(ar_row, "ours"), c1_throughput(ar_row, "base"), run.server,
                                run.settle_ratio, run.cold) + "\n", flush=True)
            records.append(baseline_record(run))
    return {"gguf": str(gguf) if gguf else None,
            "dualserve": {"url": ours_url, "model": ours_model, "args": args.dualserve_args},
            "baselines": records}


def _files(args: argparse.Namespace, cache_dir: Path, binaries: Binaries | None, log_dir: Path
           ) -> list[Path | None]:
    """The files to compare on: the made quantized ones, else the GGUF (None: both servers given)."""
    if not args.quantize_list and args.dualserve_url and args.llamacpp_url:
        return [args.gguf]
    gguf = args.gguf or default_gguf(args.cache_dir)
    if not gguf.exists():
        raise SystemExit(f"GGUF file {gguf} not found; pass --gguf (or run 'dualserve pull')")
    if not args.quantize_list:
        return [gguf]
    if (binaries is None or binaries.quantize is None) and set(args.quantize_list) - {"source"}:
        raise SystemExit("--quantize needs llama-quantize beside llama-server")
    return [gguf if q == "source" else quantized_file(binaries.quantize, cache_dir, gguf, q, args.threads, log_dir)
            for q in args.quantize_list]


def bench(args: argparse.Namespace, log_dir: Path) -> dict:
    from dualserve.models.hub import default_cache_dir

    cache_dir = default_cache_dir(args.cache_dir)
    needs_cpp = args.quantize_list or ("cpp" in args.baseline_list and not args.llamacpp_url)
    binaries = find_binaries(args.llama_server, cache_dir, args.build_jobs) if needs_cpp else None
    if binaries is not None:
        print(f"llama.cpp: {binaries.server}", file=sys.stderr, flush=True)
    files = []
    for gguf in _files(args, cache_dir, binaries, log_dir):
        baselines = [Baseline(kind, gguf, binaries, args.llamacpp_url) for kind in args.baseline_list]
        # a made file is named here; --gguf is in dualserve_argv already (parse_args)
        with dualserve_server(args, gguf if args.quantize_list else None, log_dir) as ours_url:
            if args.dualserve_url and (seen := answered_before(ours_url)):
                print(f"note: this dualserve has answered {seen} requests; eagle's suffix lookup copies answers it "
                      "has given, so start a new server for a new server's figures", file=sys.stderr, flush=True)
            files.append(asyncio.run(run_bench(args, ours_url, baselines, log_dir, gguf)))
    return {"threads": args.threads, "max_tokens": args.max_tokens, "temperature": args.temperature,
            "settle": args.settle, "prompts": str(args.prompts), "cold_tokens": args.cold_sizes,
            "cold_requests": args.cold_requests, "files": files}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    old_term = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        report = bench(args, Path(tempfile.mkdtemp(prefix="bench_llamacpp_")))
    except KeyboardInterrupt:
        print("interrupted; servers started by this command were stopped", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"bench_llamacpp: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, old_term)
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    from dualserve.models.errors import one_line

    raise SystemExit(one_line(main))
