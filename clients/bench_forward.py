"""Forward cost table: what one forward of T new tokens costs, by weight format, eager and compiled.

Run as ``python -m dualserve.clients.bench_forward`` (on a quiet machine: it times, it does not
test). For each format of ``--formats`` (``fp32 bf16 int8 int4 w4a8``) the default model (or
``--model``) is loaded in that format, and ONE sequence with ``--context`` cached tokens (128)
runs forwards of T = 1, 2, 4, 8, 16, 32, 64 new tokens through ``ModelRunner.forward`` with real
``ForwardItem``s (a block table over the KV pool, slots to store the new keys/values; the pool in
the dtype the server gives that format: bf16 for quantized formats), followed by
the output head for the last row (``runner.logits``), as one AR step, EAGLE verify or diffusion
block would. Eager and compiled forwards alternate repeat by repeat, so slow drift on a shared
machine hits both alike; each cell is the median of ``--repeats`` timed forwards after
``--warmup`` untimed ones.

``--profile`` adds, for each T, where one compiled forward's time goes (``torch.profiler``, which
adds its own overhead: read the parts against each other, not against the timed rows): the
project's kernel ops (the dot8 GEMMs, ``attend_rows``, the norms, SwiGLU and rotary angles), the
rest of the forward (the graph's own loops, its wrapper, the step's Python), and the output head.

Printed: milliseconds per forward, and each T's cost relative to T=1, with T=8/T=1 against the
1.3x target (a forward of 8 tokens, the verify and diffusion shape, should cost at most 1.3x a
forward of one). The header names the torch threads (``--threads``, default 2, as the project's
2-core machines run) and the host's CPU capability. ``--json PATH`` writes every figure.

Compiling (unless ``--no-compile``) builds exactly the two graphs a single sequence needs (one
query row, many query rows) before timing, synchronously; on a cold cache that takes 1-4 minutes
per graph on 2 cores. Inductor's caches live where the server keeps them (``<model cache>/compile``,
``TORCHINDUCTOR_CACHE_DIR``), so a run after a server start, or a second run, is quick.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

TOKENS = (1, 2, 4, 8, 16, 32, 64)
FORMATS = ("fp32", "bf16", "int8", "int4", "w4a8", "w4a16")
# format -> (load_model's quantization, dtype)
FORMAT_LOAD = {"fp32": ("none", torch.float32), "bf16": ("none", torch.bfloat16),
               "int8": ("int8", torch.float32), "int4": ("int4", torch.float32),
               "w4a8": ("w4a8", torch.float32), "w4a16": ("w4a16", torch.float32)}
TARGET_8_OVER_1 = 1.3


@dataclass
class Row:
    format: str
    mode: str                                             # "eager" or "compiled"
    ms: dict[int, float] = field(default_factory=dict)    # T -> median ms of one forward + head

    def ratio(self, t: int) -> float:
        return self.ms[t] / self.ms[1] if 1 in self.ms and t in self.ms and self.ms[1] > 0 else float("nan")


@dataclass
class Report:
    host: str
    threads: int
    context: int
    tokens: tuple[int, ...]
    repeats: int
    rows: list[Row] = field(default_factory=list)
    compile_seconds: dict[str, dict[str, float]] = field(default_factory=dict)  # format -> graph -> s
    notes: list[str] = field(default_factory=list)
    parts: dict[str, dict[int, dict[str, float]]] = field(default_factory=dict)  # format -> T -> part -> ms

    def as_json(self) -> dict:
        return {"host": self.host, "threads": self.threads, "context": self.context, "tokens": list(self.tokens),
                "repeats": self.repeats, "target_8_over_1": TARGET_8_OVER_1,
                "rows": [{"format": r.format, "mode": r.mode, "ms": {str(t): round(v, 3) for t, v in r.ms.items()},
                          "ratio_to_1": {str(t): round(r.ratio(t), 3) for t in r.ms}} for r in self.rows],
                "compile_seconds": self.compile_seconds, "notes": self.notes,
                "parts": {f: {str(t): parts for t, parts in by_t.items()} for f, by_t in self.parts.items()}}


def host_capability() -> str:
    return torch.backends.cpu.get_cpu_capability()


def load_format(fmt: str, path: Path, name: str, cache_dir: Path) -> torch.nn.Module:
    """The model (its transformer core) of ``path`` in format ``fmt``."""
    from dualserve.models.loader import load_model

    quantization, dtype = FORMAT_LOAD[fmt]
    return load_model(path, name=name, dtype=dtype, cache_dir=cache_dir, quantization=quantization).model


def served_kv_dtype(fmt: str) -> torch.dtype:
    """The KV pool's dtype the server gives a model in ``fmt`` (``deployment.kv_dtype_of``)."""
    quantization, dtype = FORMAT_LOAD[fmt]
    return torch.bfloat16 if quantization != "none" else dtype


def span_item(context: int, t: int, token_ids: torch.Tensor, block_table: list[int], block_size: int):
    """The ForwardItem of T new tokens after ``context`` cached ones, storing them in their slots."""
    from dualserve.decoders.engine.runner import ForwardItem

    positions = range(context, context + t)
    slots = [block_table[p // block_size] * block_size + p % block_size for p in positions]
    return ForwardItem(token_ids=token_ids[context: context + t], positions=positions, context_len=context,
                       block_table=block_table, slots=slots)


KERNEL_PARTS = {"dualserve::dot8_linear": "dot8 GEMMs", "dualserve::attend_rows": "attend_rows",
                "dualserve::rms_norm": "norms, SwiGLU, rotary", "dualserve::silu_mul": "norms, SwiGLU, rotary",
                "dualserve::rotary": "norms, SwiGLU, rotary"}


def forward_parts(runner, item, forwards: int = 30) -> dict[str, float]:
    """Where one forward of ``item`` (and its head) spends its time, ms per forward, from
    ``torch.profiler``: each kernel op's time on the calling thread (it waits for its team), the
    rest of the forward, and the output head for the last row."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(forwards):
            with record_function("bench.forward"):
                hidden, _ = runner.forward([item])
            with record_function("bench.head"):
                runner.logits(hidden[-1:])
    totals: dict[str, float] = {}
    for event in prof.events():  # the forward's ops only: the head's GEMM is its own part
        part = KERNEL_PARTS.get(event.name)
        parent = event.cpu_parent
        while part is not None and parent is not None and parent.name not in ("bench.forward", "bench.head"):
            parent = parent.cpu_parent
        if part is not None and parent is not None and parent.name == "bench.forward":
            totals[part] = totals.get(part, 0.0) + event.cpu_time_total / 1e3
        elif event.name in ("bench.forward", "bench.head"):
            totals[event.name] = totals.get(event.name, 0.0) + event.cpu_time_total / 1e3
    forward = totals.pop("bench.forward", 0.0)
    head = totals.pop("bench.head", 0.0)
    parts = {name: ms / forwards for name, ms in sorted(totals.items())}
    parts["rest of the forward"] = max(0.0, forward / forwards - sum(parts.values()))
    parts["output head"] = head / forwards
    return {name: round(ms, 3) for name, ms in parts.items()}


def measure(model: torch.nn.Module, *, context: int = 128, tokens: Sequence[int] = TOKENS, compiled: bool = True,
            repeats: int = 20, warmup: int = 3, block_size: int = 16, cache_dir: Path | None = None,
            kv_dtype: torch.dtype | None = None, seed: int = 0, profile: bool = False,
            log: Callable[[str], None] = print) -> tuple[dict[str, dict[int, float]], dict[str, float],
                                                         dict[int, dict[str, float]]]:
    """Median ms per forward (+ head for the last row) by mode ("eager", "compiled") and T, with
    the KV pool in ``kv_dtype`` (default: the model's dtype).

    Returns (ms by mode and T, compile seconds by graph, and with ``profile`` where each T's
    compiled forward spends its time: ``forward_parts``). Compiled rows are absent if compiling failed."""
    from dualserve.decoders.engine.attention.padded import StepShape
    from dualserve.decoders.engine.runner import ForwardItem, ModelRunner

    total = context + max(tokens)
    blocks = (total + block_size - 1) // block_size
    runner = ModelRunner(model, blocks, block_size, kv_dtype=kv_dtype, use_flash=False)
    block_table = list(range(blocks))
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (total,), generator=gen)
    if context:  # the cached context, computed once (eager)
        runner.forward([ForwardItem(ids[:context], range(context), 0, block_table,
                                    [block_table[p // block_size] * block_size + p % block_size
                                     for p in range(context)])])
    steps: dict[str, object] = {"eager": None}
    compile_seconds: dict[str, float] = {}
    if compiled:
        step = runner.compile(cache_dir, None)
        log("  compiling the step graphs (rows: decode and verify; chunks: prefill)...")
        step.warm([(StepShape(False), ()), (StepShape(True), ())])
        compile_seconds = dict(step.seconds)
        if step.failed:
            log("  compiling failed: no compiled rows for this format")
        else:
            steps["compiled"] = step
    samples: dict[str, dict[int, list[float]]] = {mode: {t: [] for t in tokens} for mode in steps}
    parts: dict[int, dict[str, float]] = {}
    for t in tokens:
        item = span_item(context, t, ids, block_table, block_size)
        for i in range(warmup + repeats):
            for mode, step in steps.items():
                runner.compiled = step
                start = time.perf_counter()
                hidden, _ = runner.forward([item])
                runner.logits(hidden[-1:])
                elapsed = time.perf_counter() - start
                if i >= warmup:
                    samples[mode][t].append(elapsed * 1e3)
        if profile and "compiled" in steps:
            runner.compiled = steps["compiled"]
            parts[t] = forward_parts(runner, item)
    runner.compiled = None
    return {mode: {t: statistics.median(v) for t, v in by_t.items()} for mode, by_t in samples.items()}, \
        compile_seconds, parts


def _fmt_ratio(x: float) -> str:
    return "-" if x != x else f"{x:.2f}x"


def format_table(report: Report) -> str:
    """The printed table: ms per T, then each T relative to T=1 with T=8/T=1 against the target."""
    tokens = report.tokens
    lines = [f"forward cost: one sequence over {report.context} cached tokens, one forward of T new tokens "
             f"+ output head for the last row; median of {report.repeats}",
             f"host capability {report.host}, torch {torch.__version__}, threads {report.threads}"]

    def grid(head: list[str], body: list[list[str]]) -> list[str]:
        widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(head)]
        out = ["  ".join(h.rjust(w) if i > 1 else h.ljust(w) for i, (h, w) in enumerate(zip(head, widths)))]
        out += ["  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
                for r in body]
        return out

    lines += ["", "ms per forward"]
    lines += grid(["format", "mode"] + [f"T={t}" for t in tokens],
                  [[r.format, r.mode] + [f"{r.ms[t]:.2f}" if t in r.ms else "-" for t in tokens]
                   for r in report.rows])
    rest = [t for t in tokens if t != 1]
    if 1 in tokens and rest:
        lines += ["", f"cost relative to T=1 (target: T=8 at most {TARGET_8_OVER_1}x T=1)"]
        body = []
        for r in report.rows:
            cells = [r.format, r.mode] + [_fmt_ratio(r.ratio(t)) for t in rest]
            if 8 in tokens:
                x = r.ratio(8)
                cells.append("-" if x != x else "met" if x <= TARGET_8_OVER_1 else
                             f"missed by {x / TARGET_8_OVER_1:.2f}x")
            body.append(cells)
        lines += grid(["format", "mode"] + [f"T={t}" for t in rest] + (["T=8 target"] if 8 in tokens else []), body)
    eager = {r.format: r for r in report.rows if r.mode == "eager"}
    compiled = {r.format: r for r in report.rows if r.mode == "compiled"}
    gains = []
    for fmt in (f for f in eager if f in compiled):
        e, c = eager[fmt], compiled[fmt]
        gains.append(f"{fmt} " + " ".join(f"T={t} {e.ms[t] / c.ms[t]:.2f}x" for t in (1, 8) if t in e.ms and t in c.ms))
    if gains:
        lines += ["", "eager ms / compiled ms: " + "; ".join(gains)]
    for fmt, by_t in report.parts.items():
        names = list(next(iter(by_t.values())))
        lines += ["", f"where a compiled {fmt} forward's time goes (ms per forward, under torch.profiler)"]
        lines += grid(["part", ""] + [f"T={t}" for t in by_t],
                      [[name, ""] + [f"{by_t[t].get(name, 0.0):.2f}" for t in by_t] for name in names])
    for fmt, secs in report.compile_seconds.items():
        if secs:
            lines.append(f"compile {fmt}: " + ", ".join(f"{k} {v:.1f} s" for k, v in secs.items()))
    lines += report.notes
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dualserve.clients.bench_forward", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model path (default: the default model's GGUF)")
    p.add_argument("--cache-dir", default=None, help="model cache (default: $DUALSERVE_CACHE or ~/.cache/dualserve)")
    p.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="the T values to time")
    p.add_argument("--context", type=int, default=128, help="cached tokens before the new ones")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--repeats", type=int, default=20, help="timed forwards per cell (the median is reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed forwards per cell first")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--no-compile", action="store_true", help="eager rows only")
    p.add_argument("--profile", action="store_true",
                   help="also print where each T's compiled forward spends its time (torch.profiler)")
    p.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args(argv)
    if any(t < 1 for t in args.tokens) or args.context < 0 or args.repeats < 1 or args.warmup < 0:
        p.error("--tokens must be >= 1, --context and --warmup >= 0, --repeats >= 1")
    args.tokens = sorted(set(args.tokens))
    return args


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> Report:
    from dualserve.models.hub import default_cache_dir, resolve_model

    torch.set_num_threads(args.threads)
    cache = default_cache_dir(args.cache_dir)
    compile_dir = cache / "compile"
    if not args.no_compile:
        # Inductor reads its cache location from the environment: set it before anything compiles.
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(compile_dir))
    name, path = resolve_model(args.model, cache)
    report = Report(host_capability(), torch.get_num_threads(), args.context, tuple(args.tokens), args.repeats)
    for fmt in args.formats:
        log(f"{fmt}: loading {path.name}")
        model = load_format(fmt, path, name, cache)
        by_mode, secs, parts = measure(model, context=args.context, tokens=args.tokens,
                                       compiled=not args.no_compile, repeats=args.repeats, warmup=args.warmup,
                                       block_size=args.block_size, cache_dir=compile_dir,
                                       kv_dtype=served_kv_dtype(fmt), profile=args.profile, log=log)
        if parts:
            report.parts[fmt] = parts
        if secs:
            report.compile_seconds[fmt] = {k: round(v, 1) for k, v in secs.items()}
        if not args.no_compile and "compiled" not in by_mode:
            report.notes.append(f"{fmt}: compiling failed, eager only")
        for mode, ms in by_mode.items():
            report.rows.append(Row(fmt, mode, ms))
            log(f"  {mode:<8} " + "  ".join(f"T={t} {v:.2f} ms" for t, v in ms.items()))
        del model
        if not args.no_compile:
            torch._dynamo.reset()  # the next format compiles afresh; this one's graphs are done with
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    print(format_table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report.as_json(), indent=2))
    return 0


if __name__ == "__main__":
    from dualserve.models.errors import one_line

    raise SystemExit(one_line(main))
