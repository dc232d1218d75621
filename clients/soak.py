"""Soak and fuzz a running server by hand: fuzzed requests plus a disconnect storm, then a leak check.

    python -m dualserve.clients.soak --url http://127.0.0.1:8000 --requests 10000 --streams 64 --minutes 10

``--streams`` clients send, together, at least ``--requests`` requests and keep going for at
least ``--minutes``:
  * fuzzed requests (``clients/fuzz.py``: valid bodies beside broken ones) on the three
    generation endpoints and every decoder; each answer must pass ``fuzz.verdict`` (no 5xx
    but a deliberate 503 / 504, OpenAI-shaped errors, streams that end with their marker);
  * every ``--storm-every``-th request is instead a longer stream on a decoder in turn that the
    client cuts after a few events (a disconnect storm: the server must free its work).
A request with no answer within ``--hang-seconds`` is a hang, reported apart from the problems.
A 429 is a deliberate rejection, not a problem: the server refuses what would wait longer
than ``--max-queue-wait`` (or overflow ``--max-waiting``), with ``Retry-After``, and ends a
stream that waited too long with a ``rate_limit_error`` event then its end. Rejections are
counted by endpoint and code; a 429 without ``Retry-After`` is a problem. The report also gives
the latency of the answered requests (p50, p99, max), so a bounded queue shows as a bounded tail.

Before and after, it reads ``/metrics``: KV pool usage, running and waiting requests, and the
server's RSS. After the run it waits (up to a minute) for the server to go idle, so leaked
blocks or requests show as a pool or queue that stays busy. The report gives the statuses by
endpoint, the problems and hangs (with examples), disconnects, pool, queue and RSS before and
after; the exit status is 1 if anything failed. ``--json PATH`` also writes it as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import httpx

from .fuzz import ENDPOINTS, is_stream, sample, verdict

STORM_DECODERS = ("ar", "eagle", "diffusion", "auto")
STORM_BODIES = {
    "/v1/completions": {"prompt": "Write a long story about a lighthouse keeper.", "max_tokens": 256},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Explain how tides work, at length."}],
                             "max_tokens": 256},
    "/infill": {"input_prefix": "def fibonacci(n):\n", "input_suffix": "\n", "n_predict": 256},
}


@dataclass
class Report:
    statuses: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    problems: list[str] = field(default_factory=list)
    hangs: list[str] = field(default_factory=list)
    rejected: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))  # endpoint -> code -> n
    latencies: list[float] = field(default_factory=list)  # seconds, answered fuzzed requests
    disconnects: int = 0
    sent: int = 0
    before: dict[str, float] = field(default_factory=dict)
    after: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"sent": self.sent, "seconds": round(self.seconds, 1), "disconnects": self.disconnects,
                "statuses": {e: dict(sorted(c.items(), key=lambda kv: str(kv[0]))) for e, c in self.statuses.items()},
                "rejected": sum(sum(c.values()) for c in self.rejected.values()),
                "rejected_by": {e: dict(c) for e, c in self.rejected.items()}, "latency_s": self.latency(),
                "problems": len(self.problems), "problem_examples": self.problems[:10], "hangs": len(self.hangs),
                "hang_examples": self.hangs[:10], "before": self.before, "after": self.after}

    def latency(self) -> dict[str, float]:
        if not self.latencies:
            return {}
        ranked = sorted(self.latencies)
        # Four decimals: a refused request answers in a few milliseconds.
        at = lambda q: round(ranked[min(len(ranked) - 1, int(q * len(ranked)))], 4)  # noqa: E731
        return {"p50": at(0.5), "p99": at(0.99), "max": round(ranked[-1], 4)}

    @property
    def failed(self) -> bool:
        leaked = self.after.get("running", 0) or self.after.get("waiting", 0) or self.after.get("kv_pool_usage", 0)
        return bool(self.problems or self.hangs or leaked)


def scrape(text: str) -> dict[str, float]:
    """The few series the soak reports, from Prometheus' text format."""
    names = {"dualserve_kv_pool_usage": "kv_pool_usage", "dualserve_requests_running": "running",
             "dualserve_requests_waiting": "waiting", "process_resident_memory_bytes": "rss_mb"}
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            out[names[name]] = float(value) / 2**20 if name.startswith("process_") else float(value)
    if "rss_mb" in out:
        out["rss_mb"] = round(out["rss_mb"], 1)
    return out


async def server_state(client: httpx.AsyncClient) -> dict[str, float]:
    r = await client.get("/metrics")
    r.raise_for_status()
    return scrape(r.text)


async def settle(client: httpx.AsyncClient, seconds: float = 60.0) -> dict[str, float]:
    """Wait until nothing runs or waits (and the pool is empty), or ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    while True:
        state = await server_state(client)
        idle = not (state.get("running") or state.get("waiting") or state.get("kv_pool_usage"))
        if idle or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.5)


def rejection(status: int, content: bytes, streamed: bool) -> str | None:
    """The error code when the server refused the request for overload: a 429, or a stream that
    ends with a ``rate_limit_error`` event (it waited too long to start); else None."""
    if status == 429:
        try:
            return json.loads(content)["error"]["code"] or "429"
        except (ValueError, KeyError, TypeError):
            return "429"
    if status == 200 and streamed and b'"rate_limit_error"' in content:
        for line in content.decode("utf-8", "replace").split("\n"):
            if line.startswith('data: {"error"'):
                error = json.loads(line[6:])["error"]
                if error.get("type") == "rate_limit_error":
                    return error.get("code") or "rate_limit_error"
    return None


async def fuzzed(client: httpx.AsyncClient, endpoint: str, raw: bytes, report: Report, hang_s: float) -> None:
    started = time.monotonic()
    try:
        r = await asyncio.wait_for(client.post(endpoint, content=raw), hang_s)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        report.hangs.append(f"{endpoint} {raw[:200]!r}")
        return
    except httpx.TransportError as e:
        report.problems.append(f"{endpoint} {raw[:200]!r} -> connection error {type(e).__name__}")
        return
    report.latencies.append(time.monotonic() - started)
    report.statuses[endpoint][r.status_code] += 1
    streamed = is_stream(raw)
    problem = verdict(r.status_code, r.content, streamed, endpoint)
    code = rejection(r.status_code, r.content, streamed)
    if code is not None:
        report.rejected[endpoint][code] += 1
        if r.status_code == 429 and "retry-after" not in r.headers:
            problem = problem or "429 without Retry-After"
    if problem is not None:
        report.problems.append(f"{endpoint} {raw[:300]!r} -> {problem}")


async def storm(client: httpx.AsyncClient, endpoint: str, decoder: str, cut_after: int, report: Report,
                hang_s: float) -> None:
    """A longer stream the client leaves after ``cut_after`` events."""
    body = {**STORM_BODIES[endpoint], "stream": True, "decoder": decoder}

    async def run() -> bool:
        """Whether the client cut the stream (False: the server refused it)."""
        async with client.stream("POST", endpoint, json=body) as r:
            report.statuses[f"{endpoint} (cut)"][r.status_code] += 1
            if r.status_code == 429:
                report.rejected[f"{endpoint} (cut)"][rejection(429, await r.aread(), False)] += 1
                return False
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen > cut_after:
                    break
        return True

    try:
        cut = await asyncio.wait_for(run(), hang_s)  # awaited first: += would read the count before the wait
        report.disconnects += cut
    except (asyncio.TimeoutError, httpx.TimeoutException):
        report.hangs.append(f"{endpoint} stream on {decoder}, cut after {cut_after} events")
    except httpx.TransportError as e:
        report.problems.append(f"{endpoint} stream on {decoder} -> connection error {type(e).__name__}")


async def soak(url: str, requests: int, streams: int, minutes: float, seed: int, storm_every: int,
               hang_s: float, api_key: str | None) -> Report:
    report = Report()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    bodies = sample(max(requests, 1), seed)
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=hang_s + 5, limits=limits) as client:
        report.before = await settle(client, 5)
        started = time.monotonic()
        until = started + minutes * 60
        counter = itertools.count()
        decoders = itertools.cycle(STORM_DECODERS)

        async def worker() -> None:
            while True:
                i = next(counter)
                if i >= requests and time.monotonic() >= until:
                    return
                report.sent += 1
                try:
                    if storm_every and i % storm_every == storm_every - 1:
                        await storm(client, ENDPOINTS[i % len(ENDPOINTS)], next(decoders), rng.randrange(0, 6),
                                    report, hang_s)
                    else:
                        await fuzzed(client, *bodies[i % len(bodies)], report, hang_s)
                except Exception as e:  # noqa: BLE001 - the soak reports, it does not stop
                    report.problems.append(f"request {i}: the soak itself failed: {type(e).__name__}: {e}")

        await asyncio.gather(*(worker() for _ in range(streams)))
        report.seconds = time.monotonic() - started
        report.after = await settle(client)
    return report


def print_report(report: Report) -> None:
    d = report.as_dict()
    print(f"sent {d['sent']} requests in {d['seconds']} s ({d['disconnects']} cut by the client)")
    for endpoint, statuses in sorted(d["statuses"].items()):
        print(f"  {endpoint:32s} " + "  ".join(f"{s}: {n}" for s, n in statuses.items()))
    print(f"rejected for overload (429, deliberate): {d['rejected']}")
    for endpoint, codes in sorted(d["rejected_by"].items()):
        print(f"  {endpoint:32s} " + "  ".join(f"{c}: {n}" for c, n in sorted(codes.items())))
    if d["latency_s"]:
        print("latency of answered requests (s): " + "  ".join(f"{k} {v}" for k, v in d["latency_s"].items()))
    print(f"problems: {d['problems']}")
    for line in d["problem_examples"]:
        print(f"  {line}")
    print(f"hangs (no answer within --hang-seconds): {d['hangs']}")
    for line in d["hang_examples"]:
        print(f"  {line}")
    for key in ("kv_pool_usage", "running", "waiting", "rss_mb"):
        print(f"  {key:14s} before {d['before'].get(key)}  after {d['after'].get(key)}")
    print("FAILED" if report.failed else "OK")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (no /v1)")
    p.add_argument("--requests", type=int, default=1000, help="at least this many requests")
    p.add_argument("--streams", type=int, default=64, help="concurrent clients")
    p.add_argument("--minutes", type=float, default=0.0, help="and for at least this long")
    p.add_argument("--seed", type=int, default=15, help="the fuzzed bodies are the same for the same seed")
    p.add_argument("--storm-every", type=int, default=4, help="every k-th request is a stream cut early (0: none)")
    p.add_argument("--hang-seconds", type=float, default=60.0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--json", default=None, help="also write the report here")
    args = p.parse_args(argv)
    report = asyncio.run(soak(args.url.rstrip("/"), args.requests, args.streams, args.minutes, args.seed,
                              args.storm_every, args.hang_seconds, args.api_key))
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**report.as_dict(), "failed": report.failed}, f, indent=1)
    return 1 if report.failed else 0


if __name__ == "__main__":
    from dualserve.models.errors import one_line

    raise SystemExit(one_line(main))
