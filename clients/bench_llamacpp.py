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
import json
import os
import shlex
import signal
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from dualserve.clients.bench import (
    DEFAULT_PROMPTS,
    BenchSpec,
    answered_before,
    interleave_kinds,
    load_prompts,
    resolve_model,
    run_level,
)
from dualserve.clients.bench_files import default_gguf, quantized_file
from dualserve.clients.bench_measure import (
    COLD_MAX_TOKENS,
    Aggregate,
    BaselineRun,
    ColdRow,
    SideBySide,
    cold_row,
    settle_compare,
    side_by_side,
)
from dualserve.clients.bench_report import baseline_record, c1_throughput, format_report, settle_ratio
from dualserve.clients.bench_servers import BASELINE_SERVERS, Baseline, baseline_server, dualserve_server, names_model
from dualserve.clients.code_prompts import TokenCounter, code_prompt, server_token_counter
from dualserve.clients.llamacpp_build import Binaries, find_binaries

DECODERS = ("ar", "eagle", "diffusion")
COLD_CTX_MARGIN = 256  # the chat template, the warm variant's added line and the answer, past the code


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


def single_stream_ctx(args: argparse.Namespace) -> int:
    """Context of the single-stream baseline: ``--ctx``, or room for the largest cold prompt."""
    return max([args.ctx, *(size + COLD_CTX_MARGIN for size in args.cold_sizes)])


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

def _raise_keyboard_interrupt(signum, frame):  # SIGTERM: unwind like Ctrl-C so servers are stopped
    raise KeyboardInterrupt


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
