"""dualserve against llama.cpp's server on the same GGUF file, same threads, in one run.

Run as::

    python -m dualserve.clients.bench_llamacpp --threads 2 --requests 12

One command starts both servers (each on a free local port, logs in a temporary directory),
or targets running ones with ``--dualserve-url`` / ``--llamacpp-url``, and prints ours /
llama.cpp ratios:

- single stream, for each dualserve decoder (``ar``, ``eagle``, ``diffusion``, selected per
  request with ``extra_body={"decoder": ...}``) against the same llama.cpp baseline. The two
  servers alternate prompt by prompt (who goes first alternates too), so noise from other work
  on a shared machine hits both alike; llama.cpp is measured again beside every decoder. Each
  measured request starts ``--settle`` seconds (default 1) after the previous one ended, so that
  neither server starts on cores the other has just been using: dualserve's OpenMP governor
  (``decoders/engine/openmp.py``) averages its neighbours' load over about half a second and
  keeps its threads from spinning for about a second after a neighbour's burst, and a 64-token
  request sent straight after llama.cpp's turn ran that whole second throttled (``--settle 0``
  measures it that way);
- aggregate throughput at concurrency 16 (``--concurrency``) for each server, and for each server
  its c16 / c1 gain (c1: completion tokens / summed request time of its single-stream ``ar`` run).

Requests are chat requests (one user message each) from ``prompts/bench.jsonl``, greedy, 64 max
tokens (``--max-tokens``), streamed through the OpenAI SDK by the load client in
``clients/bench.py`` (same TTFT / decode tok/s definitions: decode tok/s is (tokens - 1) / time
from the first to the last text chunk; token counts come from the servers' ``usage``).

Servers this command started are stopped when it exits, also on Ctrl-C or SIGTERM. Options:

- ``--dualserve-args "--quantization int4"``: extra arguments for ``dualserve serve``;
- ``--llamacpp-args "..."``: extra arguments for ``python -m llama_cpp.server``;
- ``--gguf PATH``: the GGUF file both servers serve (default: the default model's file in the
  model cache), any Llama / Qwen GGUF such as one from ``clients/write_gguf.py``; a ``--model`` in
  ``--dualserve-args`` overrides dualserve's;
- ``--json out.json``: every request, summary and ratio.

llama.cpp is not a dependency of the project. Its server comes from ``llama-cpp-python``; the
default build can crash (SIGILL / segfault in its AMX kernels) on the Q4_1 file on CPUs that
expose AMX, so build it without AMX (several minutes; ``nice`` keeps a shared machine usable)::

    CFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \\
    CXXFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \\
    CMAKE_BUILD_PARALLEL_LEVEL=1 nice -n 19 \\
    python -m pip install "llama-cpp-python[server]==0.3.36"

(if the ``[server]`` extra's dependencies are missing: ``pip install uvicorn fastapi
sse-starlette starlette-context pydantic-settings``). The llama.cpp server is started as
``python -m llama_cpp.server --model GGUF --n_threads T --n_threads_batch T
--interrupt_requests False``: by default it aborts a running stream when the next request
arrives, which would break the concurrency level.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
from typing import Iterator, Sequence

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

DECODERS = ("ar", "eagle", "diffusion")


# ---------------------------------------------------------------------------------------------
# Arguments


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dualserve.clients.bench_llamacpp",
                                description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="CPU threads for both servers (default: all cores)")
    p.add_argument("--gguf", type=Path, default=None,
                   help="GGUF file for both servers (default: the default model's file in the cache)")
    p.add_argument("--cache-dir", default=None, help="dualserve model cache (to find the default GGUF)")
    p.add_argument("--dualserve-url", help="target a running dualserve (…/v1) instead of starting one")
    p.add_argument("--llamacpp-url", help="target a running llama.cpp server (…/v1) instead of starting one")
    p.add_argument("--dualserve-args", default="", help="extra arguments for 'dualserve serve', one string")
    p.add_argument("--llamacpp-args", default="", help="extra arguments for 'python -m llama_cpp.server'")
    p.add_argument("--decoders", default=",".join(DECODERS),
                   help="comma-separated dualserve decoders for the single-stream rows")
    p.add_argument("--requests", type=int, default=12, help="single-stream requests per decoder (and server)")
    p.add_argument("--concurrency", type=int, default=16, help="level for the aggregate row; 0 skips it")
    p.add_argument("--settle", type=float, default=1.0,
                   help="seconds between one request's end and the next one's start (see the module docstring)")
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
    args = p.parse_args(argv)
    args.decoder_list = [d.strip() for d in args.decoders.split(",") if d.strip()]
    unknown = [d for d in args.decoder_list if d not in DECODERS]
    if unknown or not args.decoder_list:
        p.error(f"--decoders: expected a comma-separated subset of {','.join(DECODERS)}, got {args.decoders!r}")
    if args.threads < 1:
        p.error("--threads must be at least 1")
    if args.requests < 1:
        p.error("--requests must be at least 1")
    if args.concurrency < 0:
        p.error("--concurrency must be 0 (skip) or positive")
    if args.concurrent_requests is None:
        args.concurrent_requests = 2 * args.concurrency
    try:
        args.dualserve_argv = shlex.split(args.dualserve_args)
        args.llamacpp_argv = shlex.split(args.llamacpp_args)
    except ValueError as exc:
        p.error(f"could not split extra server arguments: {exc}")
    if args.gguf and not any(a.split("=")[0] in ("--model", "--ar") for a in args.dualserve_argv):
        args.dualserve_argv = ["--model", str(args.gguf), *args.dualserve_argv]
    return args


# ---------------------------------------------------------------------------------------------
# Servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dualserve_command(threads: int, port: int, extra: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "dualserve.server.cli", "serve", "--threads", str(threads),
            "--host", "127.0.0.1", "--port", str(port), *extra]


def llamacpp_command(gguf: Path, threads: int, port: int, extra: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf),
            "--n_threads", str(threads), "--n_threads_batch", str(threads),
            "--host", "127.0.0.1", "--port", str(port), "--interrupt_requests", "False", *extra]


@dataclass
class Server:
    """A server process this command started (own session, so its whole group can be stopped)."""

    name: str
    url: str
    proc: subprocess.Popen
    log_path: Path

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


def start_server(name: str, cmd: Sequence[str], port: int, log_dir: Path) -> Server:
    log_path = log_dir / f"{name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    return Server(name, f"http://127.0.0.1:{port}/v1", proc, log_path)


def wait_ready(server: Server, timeout: float) -> None:
    """Poll GET /v1/models until it answers 200; fail early if the process exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited with code {server.proc.returncode} while starting; "
                               f"log {server.log_path}:\n{server.log_tail()}")
        try:
            with urllib.request.urlopen(server.url + "/models", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{server.name} did not answer {server.url}/models within {timeout:.0f}s; "
                       f"log {server.log_path}:\n{server.log_tail()}")


def default_gguf(cache_dir: str | None) -> Path:
    from dualserve.models.hub import default_cache_dir, default_gguf_path

    return default_gguf_path(default_cache_dir(cache_dir))


def _raise_keyboard_interrupt(signum, frame):  # SIGTERM: unwind like Ctrl-C so servers are stopped
    raise KeyboardInterrupt


@contextlib.contextmanager
def servers(args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """Yield (dualserve url, llama.cpp url), starting whichever was not given; stop them on exit."""
    started: list[Server] = []
    old_term = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    log_dir = Path(tempfile.mkdtemp(prefix="bench_llamacpp_"))
    try:
        llama_url = args.llamacpp_url
        if not llama_url:
            gguf = args.gguf or default_gguf(args.cache_dir)
            if not gguf.exists():
                raise SystemExit(f"GGUF file {gguf} not found; pass --gguf (or run 'dualserve pull')")
            try:
                import llama_cpp  # noqa: F401  (only to fail early with a useful message)
            except ImportError:
                raise SystemExit("llama-cpp-python is not installed; see this module's docstring for how "
                                 "to build it, or pass --llamacpp-url") from None
            port = free_port()
            started.append(start_server("llama.cpp", llamacpp_command(gguf, args.threads, port, args.llamacpp_argv),
                                        port, log_dir))
            llama_url = started[-1].url
        ours_url = args.dualserve_url
        if not ours_url:
            port = free_port()
            started.append(start_server("dualserve", dualserve_command(args.threads, port, args.dualserve_argv),
                                        port, log_dir))
            ours_url = started[-1].url
        for s in started:
            print(f"starting {s.name}: {shlex.join(s.proc.args)}  (log {s.log_path})", file=sys.stderr, flush=True)
        for s in started:
            t0 = time.monotonic()
            wait_ready(s, args.startup_timeout)
            print(f"{s.name} ready in {time.monotonic() - t0:.1f}s at {s.url}", file=sys.stderr, flush=True)
        yield ours_url, llama_url
    finally:
        for s in reversed(started):
            s.stop()
        signal.signal(signal.SIGTERM, old_term)


# ---------------------------------------------------------------------------------------------
# Measurement


@dataclass
class SideBySide:
    """One single-stream comparison: dualserve with `decoder` against llama.cpp, alternating."""

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


async def timed(client, spec: BenchSpec, prompt: Prompt) -> tuple[RequestResult, float]:
    t0 = time.perf_counter()
    res = await stream_one(client, spec, prompt)
    return res, time.perf_counter() - t0


async def side_by_side(ours, ours_spec: BenchSpec, base, base_spec: BenchSpec,
                       prompts: Sequence[Prompt], n: int, warmup: int, settle: float = 0.0) -> SideBySide:
    """n prompts, each sent to both servers one after the other, ``settle`` seconds apart; who goes
    first alternates."""
    for _ in range(warmup):
        await stream_one(ours, ours_spec, WARMUP_PROMPT)
        await stream_one(base, base_spec, WARMUP_PROMPT)
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
        o, b = runs["ours"][-1], runs["base"][-1]
        print(f"  {ours_spec.decoder:<9} {prompt.id:<18} ours {_tps(o):>6} tok/s ({o.tokens:>3} tok)  "
              f"llama.cpp {_tps(b):>6} tok/s ({b.tokens:>3} tok)", file=sys.stderr, flush=True)
    return SideBySide(ours_spec.decoder or "default", summarize_level(1, runs["ours"], wall["ours"]),
                      summarize_level(1, runs["base"], wall["base"]), runs["ours"], runs["base"])


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
    return lv.decode_tps.mean if lv.decode_tps else None


def fixed_width(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    table = [list(header), *map(list, rows)]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]

    def fmt(row: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    return "\n".join([fmt(table[0]), "  ".join("-" * w for w in widths), *map(fmt, table[1:])])


SINGLE_HEADER = ("decoder", "ok", "ours tok/s", "llama.cpp tok/s", "ratio",
                 "ours TTFT ms", "llama.cpp TTFT ms", "TTFT ratio")
AGG_HEADER = ("concurrency", "ok", "ours agg tok/s", "llama.cpp agg tok/s", "ratio",
              "ours c/c1", "llama.cpp c/c1")


def single_rows(rows: Sequence[SideBySide]) -> list[list[str]]:
    out = []
    for s in rows:
        r = s.ratios
        out.append([s.decoder, f"{s.ours.n_ok}/{s.ours.n_requests} | {s.base.n_ok}/{s.base.n_requests}",
                    _f(_dec(s.ours)), _f(_dec(s.base)), _x(r["decode_tps"]),
                    _f(_ms(s.ours), "{:.0f}"), _f(_ms(s.base), "{:.0f}"), _x(r["ttft"])])
    return out


def aggregate_row(agg: Aggregate, ours_c1: float | None, base_c1: float | None) -> list[str]:
    def div(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    o, b = agg.ours.aggregate_tps, agg.base.aggregate_tps
    return [str(agg.concurrency),
            f"{agg.ours.n_ok}/{agg.ours.n_requests} | {agg.base.n_ok}/{agg.base.n_requests}",
            _f(o), _f(b), _x(div(o, b)), _x(div(o, ours_c1)), _x(div(b, base_c1))]


def format_report(title: str, single: Sequence[SideBySide], agg: Aggregate | None,
                  ours_c1: float | None = None, base_c1: float | None = None) -> str:
    """The printed report: single-stream table (decode tok/s, TTFT) and the aggregate table."""
    parts = [title, "", "single stream (decode tok/s mean; ratio = ours / llama.cpp; ok = ours | llama.cpp):",
             fixed_width(SINGLE_HEADER, single_rows(single))]
    if agg is not None:
        parts += ["", f"aggregate at concurrency {agg.concurrency} (completion tokens / wall time; "
                      "c/c1 = aggregate / single-stream ar throughput, TTFT included):",
                  fixed_width(AGG_HEADER, [aggregate_row(agg, ours_c1, base_c1)])]
    problems = []
    for label, lv in [*((f"ours {s.decoder}", s.ours) for s in single), *((f"llama.cpp beside {s.decoder}", s.base)
                                                                           for s in single),
                      *(((f"ours c{agg.concurrency}", agg.ours), (f"llama.cpp c{agg.concurrency}", agg.base))
                        if agg else ())]:
        if lv.errors:
            problems.append(f"{label}: {len(lv.errors)} failed, first: {lv.errors[0]}")
        if lv.usage_missing:
            problems.append(f"{label}: {lv.usage_missing} requests without usage (tokens counted as chunks)")
    if problems:
        parts += ["", *problems]
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------
# Main


async def run_bench(args: argparse.Namespace, ours_url: str, llama_url: str) -> dict:
    from openai import AsyncOpenAI

    prompts = interleave_kinds(load_prompts(args.prompts))
    ours = AsyncOpenAI(base_url=ours_url, api_key="EMPTY", timeout=args.timeout, max_retries=0)
    base = AsyncOpenAI(base_url=llama_url, api_key="EMPTY", timeout=args.timeout, max_retries=0)
    async with ours, base:
        ours_model, base_model = await resolve_model(ours, None), await resolve_model(base, None)

        def spec(model: str, decoder: str | None) -> BenchSpec:
            return BenchSpec(model=model, endpoint="chat", max_tokens=args.max_tokens,
                             temperature=args.temperature, decoder=decoder)

        base_spec = spec(base_model, None)  # llama.cpp is not told about decoders
        single: list[SideBySide] = []
        for d in args.decoder_list:
            print(f"single stream: dualserve decoder={d} vs llama.cpp, {args.requests} prompts", file=sys.stderr)
            single.append(await side_by_side(ours, spec(ours_model, d), base, base_spec, prompts,
                                             args.requests, args.warmup, args.settle))
        agg = None
        if args.concurrency:
            c, n = args.concurrency, args.concurrent_requests
            print(f"aggregate: concurrency {c}, {n} requests per server", file=sys.stderr, flush=True)
            b_sum, b_res = await run_level(base, base_spec, prompts, c, n)
            await asyncio.sleep(args.settle)
            o_sum, o_res = await run_level(ours, spec(ours_model, args.concurrent_decoder), prompts, c, n)
            agg = Aggregate(c, o_sum, b_sum, o_res, b_res)
    ar_row = next((s for s in single if s.decoder == args.concurrent_decoder), None)
    ours_c1, base_c1 = c1_throughput(ar_row, "ours"), c1_throughput(ar_row, "base")
    title = (f"dualserve ({ours_model}) vs llama.cpp ({Path(base_model).name}) · threads={args.threads} · "
             f"chat · max_tokens={args.max_tokens} · temperature={args.temperature} · settle={args.settle:g} s"
             + (f" · dualserve args: {args.dualserve_args}" if args.dualserve_args else ""))
    print(format_report(title, single, agg, ours_c1, base_c1))
    report = {
        "threads": args.threads, "max_tokens": args.max_tokens, "temperature": args.temperature,
        "prompts": str(args.prompts), "dualserve": {"url": ours_url, "model": ours_model, "args": args.dualserve_args},
        "llamacpp": {"url": llama_url, "model": base_model, "args": args.llamacpp_args},
        "single_stream": [
            {"decoder": s.decoder, "ratios": s.ratios,
             "ours": level_record(s.ours, s.ours_requests), "llamacpp": level_record(s.base, s.base_requests)}
            for s in single],
    }
    if agg is not None:
        report["aggregate"] = {
            "concurrency": agg.concurrency,
            "ours": level_record(agg.ours, agg.ours_requests), "llamacpp": level_record(agg.base, agg.base_requests),
            "ratio": agg.ours.aggregate_tps / agg.base.aggregate_tps if agg.base.aggregate_tps else None,
            "ours_over_c1": agg.ours.aggregate_tps / ours_c1 if ours_c1 else None,
            "llamacpp_over_c1": agg.base.aggregate_tps / base_c1 if base_c1 else None,
        }
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2), encoding="utf-8")
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        with servers(args) as (ours_url, llama_url):
            if args.dualserve_url and (seen := answered_before(ours_url)):
                print(f"note: this dualserve has answered {seen} requests; eagle's suffix lookup copies answers it "
                      "has given, so start a new server for a new server's figures", file=sys.stderr, flush=True)
            asyncio.run(run_bench(args, ours_url, llama_url))
    except KeyboardInterrupt:
        print("interrupted; servers started by this command were stopped", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"bench_llamacpp: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from dualserve.models.errors import one_line

    raise SystemExit(one_line(main))
