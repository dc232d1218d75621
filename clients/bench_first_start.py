"""A first start, timed: how long until the server decodes at its compiled speed.

Run as::

    python -m dualserve.clients.bench_first_start --threads 2

It starts ``dualserve serve`` on a new cache directory that holds only the downloaded model files
(``--keep`` links more of the real cache into it: ``converted``, ``kernels``, ``host``, ``compile``),
so the start converts the model, builds the C++ kernels, decides the weight format and builds every
compiled step graph, exactly as a user's first start does once the download is done. From the
moment the process starts it:

- waits for ``/health`` (the server serves eagerly while its graphs build);
- every ``--interval`` seconds sends one streamed chat request per decoder (``--decoders``, default
  ``ar,eagle``: the default routes), greedy, ``--max-tokens`` tokens, each a prompt the server has
  not seen, and records decode tok/s ((tokens - 1) / first-to-last chunk) and the compile
  progress on ``/status.json``;
- once every graph is built, takes ``--final`` more samples per decoder: their median is the
  compiled speed.

It prints, per decoder, the first time after which every sample reached ``--within`` (default 0.9)
of the compiled speed, beside the time the server answered ``/health`` and the time the last
graph was built. The temporary cache is removed afterwards (``--keep-cache`` keeps it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

from openai import AsyncOpenAI, OpenAI

from dualserve.clients.bench import BenchSpec, Prompt, stream_one

TOPICS = ["a lighthouse", "copper wire", "a bakery", "the moons of Jupiter", "a chess opening", "tide pools",
          "a violin maker", "solar panels", "a mountain railway", "honey bees", "a night market", "glaciers",
          "a paper airplane", "an old typewriter", "desert cacti", "a submarine cable", "a rainforest",
          "a pocket watch", "a city tram", "a harbour crane"]


@dataclass
class Sample:
    at: float                  # seconds since the process started
    decoder: str
    tokens: int
    decode_tps: float | None
    built: int | None          # graphs built so far (None: nothing left to build)
    total: int | None


@dataclass
class FirstStart:
    ready_s: float | None = None        # /health answered
    compiled_s: float | None = None     # the last graph built
    samples: list[Sample] = field(default_factory=list)
    log: str = ""


def prompt(i: int) -> str:
    return f"Write four sentences about {TOPICS[i % len(TOPICS)]}, and mention the number {1000 + 37 * i}."


def temporary_cache(real: Path, keep: Sequence[str]) -> Path:
    """A new cache directory with the real cache's downloaded models (and ``keep``) linked in."""
    tmp = Path(tempfile.mkdtemp(prefix="dualserve-first-start-"))
    for name in ("models", *keep):
        if (real / name).exists():
            (tmp / name).symlink_to(real / name)
    return tmp


def get_json(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def decode_tps(base_url: str, model: str, decoder: str, text: str, max_tokens: int) -> tuple[int, float | None]:
    """One streamed chat request timed by the load client (``bench.stream_one``): its completion
    tokens and decode tok/s."""
    spec = BenchSpec(model=model, endpoint="chat", max_tokens=max_tokens, temperature=0.0, decoder=decoder)

    async def one():
        async with AsyncOpenAI(base_url=base_url, api_key="unused", timeout=300) as client:
            return await stream_one(client, spec, Prompt(decoder, "first-start", text))

    res = asyncio.run(one())
    if res.error is not None:
        raise SystemExit(f"request failed: {res.error}")
    return res.tokens, res.decode_tps


def measure(args: argparse.Namespace, cache: Path, log_path: Path) -> FirstStart:
    port = args.port
    cmd = [sys.executable, "-m", "dualserve.server.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--cache-dir", str(cache), *(["--threads", str(args.threads)] if args.threads else [])]
    root = f"http://127.0.0.1:{port}"
    run = FirstStart()
    with open(log_path, "w") as log:
        started = time.monotonic()
        # The project's kernels are built into $DUALSERVE_CACHE (the process's cache, not --cache-dir's):
        # the new cache there too, so a first start builds them.
        env = {**os.environ, "DUALSERVE_CACHE": str(cache)}
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            while run.ready_s is None:
                if proc.poll() is not None:
                    raise SystemExit(f"dualserve exited with {proc.returncode}; log: {log_path}")
                if get_json(f"{root}/health") is not None:
                    run.ready_s = time.monotonic() - started
                time.sleep(0.2)
            model = OpenAI(base_url=f"{root}/v1", api_key="unused", timeout=30).models.list().data[0].id
            decoders = [d.strip() for d in args.decoders.split(",") if d.strip()]
            after_compiled, i = 0, 0
            while after_compiled < args.final and time.monotonic() - started < args.timeout:
                tick = time.monotonic()
                status = get_json(f"{root}/status.json") or {}
                compiling = status.get("compile")
                if compiling is None and run.compiled_s is None:
                    run.compiled_s = tick - started
                for decoder in decoders:
                    tokens, tps = decode_tps(f"{root}/v1", model, decoder, prompt(i), args.max_tokens)
                    i += 1
                    run.samples.append(Sample(round(time.monotonic() - started, 1), decoder, tokens, tps,
                                              compiling["built"] if compiling else None,
                                              compiling["total"] if compiling else None))
                    graphs = "all built" if compiling is None else f"{compiling['built']} of {compiling['total']}"
                    print(f"  {run.samples[-1].at:6.1f} s  {decoder:6s} {tps or 0:6.1f} tok/s  graphs {graphs}",
                          flush=True)
                after_compiled += run.compiled_s is not None
                time.sleep(max(0.0, args.interval - (time.monotonic() - tick)))
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    run.log = str(log_path)
    return run


def report(run: FirstStart, decoders: Sequence[str], within: float) -> list[str]:
    lines = [f"ready (/health) after {run.ready_s:.1f} s; every graph built by "
             f"{'-' if run.compiled_s is None else f'{run.compiled_s:.0f} s'}"]
    for decoder in decoders:
        mine = [s for s in run.samples if s.decoder == decoder and s.decode_tps]
        final = [s.decode_tps for s in mine if s.built is None]
        if not final:
            lines.append(f"{decoder}: no sample after the last graph was built")
            continue
        speed = statistics.median(final)
        # The first sample from which on every sample is within reach of the compiled speed.
        reached = next((s.at for k, s in enumerate(mine) if all(t.decode_tps >= within * speed for t in mine[k:])),
                       None)
        lines.append(f"{decoder}: compiled speed {speed:.1f} tok/s; every sample >= {within:.0%} of it from "
                     f"{reached:.0f} s after the start" if reached is not None else f"{decoder}: never steady")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dualserve.clients.bench_first_start", description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--cache-dir", default=None, help="the real cache (default: dualserve's)")
    p.add_argument("--keep", default="", help="comma-separated cache entries to reuse: converted, kernels, host, compile")
    p.add_argument("--decoders", default="ar,eagle")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--interval", type=float, default=5.0)
    p.add_argument("--final", type=int, default=3, help="sample rounds after the last graph is built")
    p.add_argument("--within", type=float, default=0.9)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--keep-cache", action="store_true")
    p.add_argument("--json", dest="json_out", default=None)
    args = p.parse_args(argv)
    from dualserve.models.hub import default_cache_dir

    real = Path(default_cache_dir(args.cache_dir))
    if not any((real / "models").glob("*.gguf")):
        raise SystemExit(f"no downloaded model in {real / 'models'}: run 'dualserve pull' first")
    cache = temporary_cache(real, [k.strip() for k in args.keep.split(",") if k.strip()])
    print(f"first start on {cache} (cpus: {os.cpu_count()})", flush=True)
    try:
        run = measure(args, cache, cache.parent / f"{cache.name}.log")
    finally:
        if not args.keep_cache:
            shutil.rmtree(cache, ignore_errors=True)
    lines = report(run, [d.strip() for d in args.decoders.split(",") if d.strip()], args.within)
    print("\n".join(lines))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({**asdict(run), "report": lines}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
