"""Single-stream ``dualserve generate`` speed alone and beside a CPU-bound neighbour process.

Run as::

    python -m dualserve.clients.bench_neighbour --threads 2
    python -m dualserve.clients.bench_neighbour            # the project's default threads

Each measurement is one real ``dualserve generate --chat PROMPT`` process (so whatever the CLI
sets up, threads and OpenMP settings included, is what gets measured), greedy, 64 max tokens,
and its own ``[N tokens in S s, R tok/s]`` line is parsed: tokens / generation time, prefill
included, model loading excluded. The runs alternate "alone" and "busy" (``--repeats`` pairs,
who goes first alternating); "busy" runs with ``--neighbours`` (default 1) Python busy loops
(``while True: pass``, not pinned to any core) started just before and stopped just after the
generate process. It prints the median tok/s of each condition and busy / alone.

On a 2-core machine, a fair share beside one busy neighbour is about half the cores; a ratio far
below that (e.g. 0.04x, 16 -> 0.6 tok/s) is the collapse that spinning OpenMP threads cause when
one of them is descheduled. ``--generate-args "--decoder eagle"`` passes more flags to generate.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Sequence

DEFAULT_PROMPT = "Hi! I just moved to a new city and don't know anyone. Any tips for making friends?"
RESULT_RE = re.compile(r"\[(\d+) tokens in ([0-9.]+)s, ([0-9.]+) tok/s")
BUSY_LOOP = "while True:\n    pass\n"


@dataclass
class Run:
    condition: str  # "alone" or "busy"
    tokens: int
    seconds: float
    wall_s: float  # the whole process, model loading included

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dualserve.clients.bench_neighbour",
                                description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=None,
                   help="passed to dualserve generate (default: none, the project's default)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="alone/busy pairs")
    p.add_argument("--neighbours", type=int, default=1, help="busy-loop processes in the busy condition")
    p.add_argument("--generate-args", default="", help="more flags for 'dualserve generate', one string")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per generate process")
    p.add_argument("--json", type=Path, dest="json_out")
    args = p.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be at least 1")
    if args.repeats < 1 or args.neighbours < 1:
        p.error("--repeats and --neighbours must be at least 1")
    args.generate_argv = shlex.split(args.generate_args)
    return args


def generate_command(args: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, "-m", "dualserve.server.cli", "generate", "--chat", args.prompt,
           "--max-tokens", str(args.max_tokens), "--temperature", "0"]
    if args.threads is not None:
        cmd += ["--threads", str(args.threads)]
    return cmd + args.generate_argv


def parse_result(stderr: str) -> tuple[int, float]:
    """(tokens, seconds) from generate's last '[N tokens in S s, R tok/s ...]' line."""
    found = RESULT_RE.findall(stderr)
    if not found:
        raise ValueError("no '[N tokens in S s, R tok/s]' line in dualserve generate's output")
    n, s, _ = found[-1]
    return int(n), float(s)


@contextlib.contextmanager
def neighbours(count: int) -> Iterator[list[subprocess.Popen]]:
    procs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP], stdin=subprocess.DEVNULL)
             for _ in range(count)]
    try:
        time.sleep(0.5)  # let them get going
        yield procs
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
        for p in procs:
            p.wait()


def run_once(args: argparse.Namespace, condition: str) -> Run:
    cmd = generate_command(args)
    t0 = time.perf_counter()
    ctx = neighbours(args.neighbours) if condition == "busy" else contextlib.nullcontext()
    with ctx:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, stdin=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"dualserve generate exited with {proc.returncode}:\n{proc.stderr[-2000:]}")
    tokens, seconds = parse_result(proc.stderr)
    return Run(condition, tokens, seconds, wall)


def summarize(runs: Sequence[Run]) -> dict:
    def median(cond: str) -> float | None:
        xs = [r.tps for r in runs if r.condition == cond]
        return statistics.median(xs) if xs else None

    alone, busy = median("alone"), median("busy")
    return {"alone_tps": alone, "busy_tps": busy, "ratio": busy / alone if alone and busy is not None else None}


def format_summary(threads: int | None, neighbours_n: int, s: dict) -> str:
    def f(x: float | None, fmt: str) -> str:
        return "-" if x is None else fmt.format(x)

    label = "default" if threads is None else str(threads)
    return (f"threads={label}  alone {f(s['alone_tps'], '{:.1f}')} tok/s  "
            f"beside {neighbours_n} busy neighbour(s) {f(s['busy_tps'], '{:.1f}')} tok/s  "
            f"busy/alone {f(s['ratio'], '{:.2f}x')}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    runs: list[Run] = []
    print(f"command: {shlex.join(generate_command(args))}", file=sys.stderr)
    try:
        for i in range(args.repeats):
            for cond in (("alone", "busy") if i % 2 == 0 else ("busy", "alone")):
                r = run_once(args, cond)
                runs.append(r)
                print(f"  {cond:<5} {r.tokens:>3} tokens in {r.seconds:6.2f}s  {r.tps:6.1f} tok/s  "
                      f"(process {r.wall_s:.1f}s)", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        return 130
    except (RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
        print(f"bench_neighbour: {exc}", file=sys.stderr)
        return 1
    s = summarize(runs)
    print(format_summary(args.threads, args.neighbours, s))
    if args.json_out:
        args.json_out.write_text(json.dumps({"threads": args.threads, "neighbours": args.neighbours,
                                             "prompt": args.prompt, "max_tokens": args.max_tokens, **s,
                                             "runs": [asdict(r) | {"tps": r.tps} for r in runs]}, indent=2))
    return 0


if __name__ == "__main__":
    from dualserve.models.errors import one_line

    raise SystemExit(one_line(main))
