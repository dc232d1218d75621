"""Streaming load client for any OpenAI-compatible server (dualserve, llama.cpp's server, vLLM...).

Run as ``python -m dualserve.clients.bench --base-url http://127.0.0.1:8000/v1``. For each
concurrency level it sends a fixed number of streamed requests (greedy by default) with the
official ``openai`` SDK, keeping ``concurrency`` requests in flight, and reports:

- TTFT: time from sending a request to the first chunk that carries text;
- ITL: gaps between successive text chunks. One chunk is one token for an AR decoder, but
  speculative (``eagle``) and diffusion decoders may stream several tokens per chunk, so ITL then
  measures the stalls a reader sees; TPOT (decode time / (tokens - 1)) stays per token;
- decode tok/s per request: (completion tokens - 1) / (last chunk - first chunk);
- aggregate tok/s: all completion tokens of a level / wall time of the level.

Token counts come from the server's ``usage`` (``stream_options.include_usage``), not from the
number of chunks, for the same multi-token-chunk reason; a request whose server sends no usage
falls back to its chunk count and is flagged in the JSON output.

With ``--baseline-url`` the same single-stream requests are also sent to a second server and
the ratios ours / baseline are printed. Prompts come from ``prompts/bench.jsonl`` next to this
file: one ``{"id", "kind", "prompt"}`` object per line, sent as a single user message (chat, the
default: the prompts are instructions for an instruct model) or as the raw prompt (completions).
Requests take the prompts round-robin over kinds, so every level mixes chat, code, extraction,
summaries, facts and arithmetic, and every server sees the same sequence.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, Sequence

from openai import AsyncOpenAI

Endpoint = Literal["completions", "chat"]
Decoder = Literal["ar", "eagle", "diffusion"]

DEFAULT_PROMPTS = Path(__file__).parent / "prompts" / "bench.jsonl"


@dataclass(frozen=True)
class Prompt:
    id: str
    kind: str
    prompt: str


# Warm-up requests use a prompt outside every measured set: EAGLE's suffix lookup keeps the
# outputs of earlier requests, and a warm-up on a measured prompt let it draft that prompt's whole
# answer from the cache (one run read 348 tok/s for eagle on its warm-up prompt, 120-230 on the rest).
WARMUP_PROMPT = Prompt("warmup", "warmup", "List three colours of the rainbow.")


@dataclass(frozen=True)
class BenchSpec:
    """What every request of one server's run looks like."""

    model: str
    endpoint: Endpoint
    max_tokens: int
    temperature: float
    decoder: Decoder | None  # sent as extra_body={"decoder": ...}; None sends nothing


@dataclass
class RequestResult:
    """One streamed request; times are time.perf_counter() seconds."""

    prompt_id: str
    kind: str
    t_start: float
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk carrying text
    text: str = ""
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    usage_reported: bool = False
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        """Finished cleanly; a request may be ok yet stream no text (EOS as the first token)."""
        return self.error is None

    @property
    def tokens(self) -> int:
        """Completion tokens: server usage when reported, else the chunk count."""
        if self.completion_tokens is not None:
            return self.completion_tokens
        return len(self.chunk_times)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.t_start if self.chunk_times else None

    @property
    def decode_time(self) -> float:
        return self.chunk_times[-1] - self.chunk_times[0] if self.chunk_times else 0.0

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first."""
        if self.tokens < 2 or self.decode_time <= 0:
            return None
        return self.decode_time / (self.tokens - 1)

    @property
    def decode_tps(self) -> float | None:
        tpot = self.tpot
        return 1.0 / tpot if tpot else None

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


@dataclass(frozen=True)
class Stats:
    mean: float
    p50: float
    p90: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Stats | None:
        if not values:
            return None
        return cls(statistics.fmean(values), percentile(values, 50), percentile(values, 90), len(values))


@dataclass(frozen=True)
class LevelSummary:
    """Everything measured at one concurrency level."""

    concurrency: int
    n_requests: int
    n_ok: int
    wall_s: float
    completion_tokens: int
    aggregate_tps: float
    ttft: Stats | None
    itl: Stats | None
    tpot: Stats | None
    decode_tps: Stats | None
    # Decode tokens over decode seconds, summed over requests: each request weighs by its length, so
    # a short reply whose chunks arrive together cannot swing it the way it swings the mean of rates.
    pooled_decode_tps: float | None
    usage_missing: int
    n_empty: int  # ok requests that streamed no text
    errors: list[str]


def answered_before(base_url: str) -> int:
    """Requests a running dualserve has finished (its ``/metrics``), 0 where it does not say. A server
    that has answered a prompt keeps the answer in ``eagle``'s suffix cache and copies it when asked
    again, so its figures are not a new server's."""
    root = base_url.rstrip("/").removesuffix("/v1")
    try:
        with urllib.request.urlopen(f"{root}/metrics", timeout=5) as r:
            text = r.read().decode()
    except (OSError, ValueError):
        return 0
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("dualserve_requests_total{")))


def percentile(values: Sequence[float], q: float) -> float:
    """Percentile with linear interpolation between closest ranks (numpy's default method)."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def load_prompts(path: Path | str = DEFAULT_PROMPTS) -> list[Prompt]:
    """Read a JSONL prompt set; every non-blank line must hold string "id", "kind" and "prompt"."""
    prompts: list[Prompt] = []
    seen: set[str] = set()
    for lineno, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        obj = json.loads(line)
        missing = [k for k in ("id", "kind", "prompt") if not isinstance(obj.get(k), str)]
        if missing:
            raise ValueError(f"{path}:{lineno}: missing or non-string keys {missing}")
        if obj["id"] in seen:
            raise ValueError(f"{path}:{lineno}: duplicate id {obj['id']!r}")
        seen.add(obj["id"])
        prompts.append(Prompt(obj["id"], obj["kind"], obj["prompt"]))
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def interleave_kinds(prompts: Sequence[Prompt]) -> list[Prompt]:
    """Round-robin over kinds (first prompt of each kind, then the second...), keeping file order
    within a kind, so that a short run still mixes chat, code, extraction and the rest."""
    by_kind: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_kind.setdefault(p.kind, []).append(p)
    rounds = max(len(group) for group in by_kind.values())
    return [group[i] for i in range(rounds) for group in by_kind.values() if i < len(group)]


def pooled_decode_tps(results: Sequence[RequestResult]) -> float | None:
    timed = [r for r in results if r.tpot is not None]
    seconds = sum(r.decode_time for r in timed)
    return sum(r.tokens - 1 for r in timed) / seconds if seconds > 0 else None


def summarize_level(concurrency: int, results: Sequence[RequestResult], wall_s: float) -> LevelSummary:
    ok = [r for r in results if r.ok]
    tokens = sum(r.tokens for r in ok)

    def collect(attr: str) -> list[float]:
        return [v for r in ok if (v := getattr(r, attr)) is not None]

    return LevelSummary(
        concurrency=concurrency,
        n_requests=len(results),
        n_ok=len(ok),
        wall_s=wall_s,
        completion_tokens=tokens,
        aggregate_tps=tokens / wall_s if wall_s > 0 else 0.0,
        ttft=Stats.of(collect("ttft")),
        itl=Stats.of([g for r in ok for g in r.gaps]),
        tpot=Stats.of(collect("tpot")),
        decode_tps=Stats.of(collect("decode_tps")),
        pooled_decode_tps=pooled_decode_tps(ok),
        usage_missing=sum(not r.usage_reported for r in ok),
        n_empty=sum(not r.chunk_times for r in ok),
        errors=[r.error for r in results if r.error is not None],
    )


def ratios(ours: LevelSummary, base: LevelSummary) -> dict[str, float | None]:
    """ours / baseline for the single-stream headline numbers (None where either side lacks data)."""

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    def mean(s: Stats | None) -> float | None:
        return s.mean if s else None

    return {
        "decode_tps": ratio(ours.pooled_decode_tps, base.pooled_decode_tps),
        "aggregate_tps": ratio(ours.aggregate_tps, base.aggregate_tps),
        "ttft": ratio(mean(ours.ttft), mean(base.ttft)),
        "tpot": ratio(mean(ours.tpot), mean(base.tpot)),
    }


COLUMNS = (
    "server", "conc", "ok/n", "TTFT ms mean", "TTFT p50", "TTFT p90",
    "ITL ms mean", "ITL p50", "ITL p90", "TPOT ms", "decode tok/s", "agg tok/s",
)


def _ms(s: Stats | None, attr: str) -> str:
    return f"{getattr(s, attr) * 1e3:.1f}" if s else "-"


def level_row(label: str, lv: LevelSummary) -> list[str]:
    """One table row, cells in COLUMNS order."""
    return [
        label, str(lv.concurrency), f"{lv.n_ok}/{lv.n_requests}",
        _ms(lv.ttft, "mean"), _ms(lv.ttft, "p50"), _ms(lv.ttft, "p90"),
        _ms(lv.itl, "mean"), _ms(lv.itl, "p50"), _ms(lv.itl, "p90"),
        _ms(lv.tpot, "mean"),
        f"{lv.decode_tps.mean:.1f}" if lv.decode_tps else "-",
        f"{lv.aggregate_tps:.1f}",
    ]


def ratio_lines(r: dict[str, float | None]) -> list[str]:
    names = {
        "decode_tps": "decode tok/s (higher is better)",
        "aggregate_tps": "aggregate tok/s (higher is better)",
        "ttft": "TTFT (lower is better)",
        "tpot": "TPOT (lower is better)",
    }
    return [f"{names[k]}: {'-' if v is None else f'{v:.2f}x'}" for k, v in r.items()]


def format_plain(rows: Sequence[Sequence[str]]) -> str:
    """Fixed-width text table with COLUMNS as header, numbers right-aligned."""
    table = [list(COLUMNS), *map(list, rows)]
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS))]

    def fmt(row: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    return "\n".join([fmt(table[0]), "  ".join("-" * w for w in widths), *map(fmt, table[1:])])


def print_report(rows: Sequence[Sequence[str]], ratio_text: Sequence[str], title: str) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        print(format_plain(rows))
        if ratio_text:
            print("ours / baseline, single stream:")
            print("\n".join(f"  {line}" for line in ratio_text))
        return
    table = Table(title=title)
    for i, col in enumerate(COLUMNS):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    console = Console()
    if not console.is_terminal:
        # Piped or redirected output would otherwise be cut to 80 columns and squash the table.
        console = Console(width=160)
    console.print(table)
    if ratio_text:
        console.print("ours / baseline, single stream:")
        for line in ratio_text:
            console.print(f"  {line}")


async def stream_one(client: AsyncOpenAI, spec: BenchSpec, prompt: Prompt) -> RequestResult:
    """Send one streamed request and time every chunk that carries text."""
    res = RequestResult(prompt.id, prompt.kind, t_start=time.perf_counter())
    common = dict(
        model=spec.model, max_tokens=spec.max_tokens, temperature=spec.temperature, stream=True,
        stream_options={"include_usage": True},
        extra_body={"decoder": spec.decoder} if spec.decoder else None,
    )
    parts: list[str] = []
    try:
        if spec.endpoint == "chat":
            messages = [{"role": "user", "content": prompt.prompt}]
            stream = await client.chat.completions.create(messages=messages, **common)
        else:
            stream = await client.completions.create(prompt=prompt.prompt, **common)
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                res.completion_tokens = chunk.usage.completion_tokens
                res.prompt_tokens = chunk.usage.prompt_tokens
                res.usage_reported = True
            for choice in chunk.choices:
                piece = choice.delta.content if spec.endpoint == "chat" else choice.text
                if piece:
                    parts.append(piece)
                    res.chunk_times.append(now)
                res.finish_reason = choice.finish_reason or res.finish_reason
    except Exception as exc:  # a failed request is reported in the summary, not fatal to the run
        res.error = f"{type(exc).__name__}: {exc}"
    if res.error is None and res.finish_reason is None:
        # A stream cut short (e.g. llama-cpp-python's server, by default, aborts a running stream
        # when the next request arrives) ends without a finish_reason.
        res.error = "stream ended without a finish_reason"
    res.text = "".join(parts)
    return res


async def run_level(
    client: AsyncOpenAI, spec: BenchSpec, prompts: Sequence[Prompt], concurrency: int, n_requests: int
) -> tuple[LevelSummary, list[RequestResult]]:
    """Send n_requests (prompts taken in order, cycling) with at most `concurrency` in flight.

    Results come back in submission order, so request i used prompts[i % len(prompts)].
    """
    pending = iter(range(n_requests))
    results: list[RequestResult | None] = [None] * n_requests

    async def worker() -> None:
        for i in pending:  # the shared iterator hands each index to exactly one worker
            results[i] = await stream_one(client, spec, prompts[i % len(prompts)])

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, n_requests))))
    wall = time.perf_counter() - t0
    done = [r for r in results if r is not None]
    return summarize_level(concurrency, done, wall), done


async def resolve_model(client: AsyncOpenAI, model: str | None) -> str:
    if model:
        return model
    models = await client.models.list()
    if not models.data:
        raise SystemExit(f"{client.base_url} lists no models; pass --model")
    return models.data[0].id


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dualserve.clients.bench", description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", help="model id (default: first from /v1/models)")
    p.add_argument("--api-key", default="EMPTY")
    p.add_argument("--concurrency", default="1,4,16,64", help="comma-separated levels")
    p.add_argument("--requests", type=int, help="requests per level (default: max(16, 2 x concurrency))")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--endpoint", choices=["completions", "chat"], default="chat",
                   help="chat sends each prompt as one user message (the prompts are instructions)")
    p.add_argument("--decoder", choices=["ar", "eagle", "diffusion"])
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests sent to each server first")
    p.add_argument("--baseline-url", help="second server for the single-stream comparison")
    p.add_argument("--baseline-model", help="model id on the baseline server (default: first listed)")
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    p.add_argument("--json", type=Path, dest="json_out", help="write all results here")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    args = p.parse_args(argv)
    try:
        args.levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        p.error(f"--concurrency: expected comma-separated integers, got {args.concurrency!r}")
    if not args.levels or min(args.levels) < 1:
        p.error("--concurrency: levels must be positive")
    return args


def level_record(summary: LevelSummary, results: Sequence[RequestResult]) -> dict:
    """JSON-ready level: the summary plus every request, with times in seconds from the level's start."""
    t0 = min((r.t_start for r in results), default=0.0)
    record = asdict(summary)
    record["requests"] = [
        asdict(r) | {
            "t_start": round(r.t_start - t0, 6),
            "chunk_times": [round(t - r.t_start, 6) for t in r.chunk_times],
            "ttft": r.ttft, "tpot": r.tpot, "decode_tps": r.decode_tps, "tokens": r.tokens,
        }
        for r in results
    ]
    return record


async def bench_server(
    url: str, model: str | None, args: argparse.Namespace, prompts: Sequence[Prompt],
    levels: Sequence[int], decoder: Decoder | None,
) -> tuple[BenchSpec, list[tuple[LevelSummary, list[RequestResult]]]]:
    """Warm one server up, then run every level against it in order."""
    client = AsyncOpenAI(base_url=url, api_key=args.api_key, timeout=args.timeout, max_retries=0)
    async with client:
        spec = BenchSpec(
            model=await resolve_model(client, model), endpoint=args.endpoint,
            max_tokens=args.max_tokens, temperature=args.temperature, decoder=decoder,
        )
        for _ in range(args.warmup):
            await stream_one(client, spec, WARMUP_PROMPT)
        runs = []
        for c in levels:
            n = args.requests if args.requests else max(16, 2 * c)
            runs.append(await run_level(client, spec, prompts, c, n))
    return spec, runs


async def main_async(args: argparse.Namespace) -> dict:
    """Run every level against the server (and level 1 against the baseline), print, save JSON."""
    prompts = interleave_kinds(load_prompts(args.prompts))
    # Ratios compare single streams, so level 1 is always run when there is a baseline.
    levels = args.levels if not args.baseline_url or 1 in args.levels else [1, *args.levels]
    spec, runs = await bench_server(args.base_url, args.model, args, prompts, levels, args.decoder)
    labelled = [("ours", s) for s, _ in runs]
    report: dict = {
        "server": {"url": args.base_url, **asdict(spec)},
        "prompts": str(args.prompts),
        "levels": [level_record(s, r) for s, r in runs],
    }
    ratio_text: list[str] = []
    if args.baseline_url:
        # The baseline is not told about decoders: it is compared as a plain AR server.
        bspec, bruns = await bench_server(args.baseline_url, args.baseline_model, args, prompts, [1], None)
        base = bruns[0][0]
        labelled.append(("baseline", base))
        report["baseline"] = {"url": args.baseline_url, **asdict(bspec), "level": level_record(*bruns[0])}
        report["ratios"] = ratios(next(s for s, _ in runs if s.concurrency == 1), base)
        ratio_text = ratio_lines(report["ratios"])
    title = f"{spec.model} · {spec.endpoint} · max_tokens={spec.max_tokens} · decoder={spec.decoder or 'default'}"
    print_report([level_row(label, s) for label, s in labelled], ratio_text, title)
    for label, s in labelled:
        if s.errors:
            print(f"{label}, concurrency {s.concurrency}: {len(s.errors)} failed, first: {s.errors[0]}")
        if s.n_empty:
            print(f"{label}, concurrency {s.concurrency}: {s.n_empty} requests finished without streaming text")
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2), encoding="utf-8")
    return report


def main(argv: Sequence[str] | None = None) -> None:
    asyncio.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    from dualserve.models.errors import one_line

    raise SystemExit(one_line(main))
