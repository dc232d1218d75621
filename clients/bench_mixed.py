"""A mixed workload through ``auto`` against forcing every request onto one decoder.

Three traffic classes run at once, as a bank's GPUs would see them:
  * interactive: single requests with a latency budget (code completion, extraction);
  * high_value: reasoning-style chat where lossless output matters;
  * batch: offline summaries, throughput-bound.

Each policy (``auto`` and each decoder forced) replays the same schedule of
requests; the report gives per-class latency (TTFT, end-to-end p50/p90) and
throughput, and which decoder ``auto`` chose for each class.

    python -m dualserve.clients.bench_mixed --base-url http://127.0.0.1:8000/v1 --duration 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

from openai import AsyncOpenAI

from .bench import load_prompts

CLASSES = {
    "interactive": {"priority": "interactive", "latency_budget_ms": 500, "max_tokens": 32, "kinds": ("code", "json_extraction")},
    "high_value": {"priority": "high_value", "max_tokens": 64, "kinds": ("arithmetic", "factual", "chat")},
    "batch": {"priority": "batch", "max_tokens": 64, "kinds": ("summarization", "summarisation", "chat")},
}


@dataclass
class Outcome:
    cls: str
    decoder: str | None
    ttft: float | None
    latency: float
    tokens: int
    error: str | None = None


@dataclass
class ClassReport:
    requests: int = 0
    errors: int = 0
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    decoders: Counter = field(default_factory=Counter)


def pick_prompts(cls: str, prompts, rng: random.Random) -> str:
    kinds = CLASSES[cls]["kinds"]
    pool = [p for p in prompts if p.kind in kinds] or list(prompts)
    return rng.choice(pool).prompt


async def one(client: AsyncOpenAI, model: str, cls: str, prompt: str, decoder: str) -> Outcome:
    spec = CLASSES[cls]
    body = {"decoder": decoder, "priority": spec["priority"]}
    if "latency_budget_ms" in spec:
        body["latency_budget_ms"] = spec["latency_budget_ms"]
    start = time.perf_counter()
    first = None
    tokens = 0
    try:
        raw = await client.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=spec["max_tokens"],
            temperature=0, stream=True, stream_options={"include_usage": True}, extra_body=body)
        routed = raw.headers.get("x-dualserve-decoder")
        async for chunk in raw.parse():  # an AsyncStream, not awaitable
            if chunk.choices and chunk.choices[0].delta.content and first is None:
                first = time.perf_counter() - start
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return Outcome(cls, routed, first, time.perf_counter() - start, tokens)
    except Exception as e:  # noqa: BLE001 - a benchmark records failures and goes on
        return Outcome(cls, None, None, time.perf_counter() - start, 0, f"{type(e).__name__}: {e}")


def schedule(duration: float, rates: dict[str, float], seed: int) -> list[tuple[float, str]]:
    """Poisson arrivals per class over ``duration`` seconds (the same schedule for every policy)."""
    rng = random.Random(seed)
    events = []
    for cls, rate in rates.items():
        t = 0.0
        while rate > 0:
            t += rng.expovariate(rate)
            if t >= duration:
                break
            events.append((t, cls))
    return sorted(events)


async def run_policy(client: AsyncOpenAI, model: str, decoder: str, events, prompts, seed: int):
    rng = random.Random(seed)
    start = time.perf_counter()
    tasks = []
    for at, cls in events:
        delay = at - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(client, model, cls, pick_prompts(cls, prompts, rng), decoder)))
    outcomes = await asyncio.gather(*tasks)
    return outcomes, time.perf_counter() - start


def summarize(outcomes: Sequence[Outcome]) -> dict[str, ClassReport]:
    reports: dict[str, ClassReport] = {c: ClassReport() for c in CLASSES}
    for o in outcomes:
        r = reports[o.cls]
        r.requests += 1
        if o.error:
            r.errors += 1
            continue
        r.tokens += o.tokens
        r.latency.append(o.latency)
        if o.ttft is not None:
            r.ttft.append(o.ttft)
        r.decoders[o.decoder] += 1
    return reports


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def table(results: dict[str, tuple[dict[str, ClassReport], float]]) -> str:
    lines = [f"{'policy':<10} {'class':<12} {'n':>4} {'err':>4} {'ttft p50':>9} {'lat p50':>8} {'lat p90':>8} "
             f"{'tok/s':>7}  decoders"]
    for policy, (reports, wall) in results.items():
        for cls, r in reports.items():
            fmt = (lambda v: f"{v:.2f}" if v is not None else "-")
            lines.append(f"{policy:<10} {cls:<12} {r.requests:>4} {r.errors:>4} "
                         f"{fmt(statistics.median(r.ttft) if r.ttft else None):>9} {fmt(pct(r.latency, .5)):>8} "
                         f"{fmt(pct(r.latency, .9)):>8} {r.tokens / wall:>7.1f}  {dict(r.decoders)}")
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> dict:
    client = AsyncOpenAI(base_url=args.base_url, api_key=args.api_key, timeout=600)
    models = await client.models.list()
    card = next(m for m in models.data if args.model in (None, m.id))
    available = getattr(card, "decoders", None) or ["ar"]
    policies = ["auto"] + [d for d in ("ar", "eagle", "diffusion") if d in available]
    if args.policies:
        policies = [p for p in policies if p in args.policies.split(",")]
    prompts = load_prompts(args.prompts) if args.prompts else load_prompts()
    rates = {"interactive": args.interactive_rate, "high_value": args.high_value_rate, "batch": args.batch_rate}
    events = schedule(args.duration, rates, args.seed)
    results = {}
    for policy in policies:
        outcomes, wall = await run_policy(client, card.id, policy, events, prompts, args.seed)
        results[policy] = (summarize(outcomes), wall)
    print(table(results))
    return {p: {c: {"requests": r.requests, "errors": r.errors, "tokens_per_s": r.tokens / wall,
                    "ttft_p50": statistics.median(r.ttft) if r.ttft else None, "latency_p50": pct(r.latency, .5),
                    "latency_p90": pct(r.latency, .9), "decoders": dict(r.decoders)}
                for c, r in reports.items()} for p, (reports, wall) in results.items()}


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--api-key", default="unused")
    p.add_argument("--model", default=None)
    p.add_argument("--prompts", default=None)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per policy")
    p.add_argument("--interactive-rate", type=float, default=0.5, help="requests/s")
    p.add_argument("--high-value-rate", type=float, default=0.2)
    p.add_argument("--batch-rate", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", default=None, help="comma-separated subset of auto,ar,eagle,diffusion")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    out = asyncio.run(main_async(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    from dualserve.models.errors import one_line

    raise SystemExit(one_line(main))
