"""Prometheus metrics and unit economics, on a registry owned by the app (no global state).

Request-level series (requests by decoder and status, tokens in and out,
time to first token, inter-token latency, forward passes, tokens per forward,
EAGLE acceptance length) are observed by the service as responses finish.
Engine-level gauges (block pool usage, running and waiting choices, device
utilisation) are sampled at scrape time from the engine's ``snapshot()``.

Unit economics: effective cost per token = node cost per hour / (throughput x
utilisation), from ``--node-cost-per-hour``. Throughput is measured over a
sliding window per decoder; utilisation is the share of wall time the engine
spent running steps. A small history feeds the status page.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class Sample:
    at: float
    decoder: str
    tokens: int


@dataclass
class Metrics:
    node_cost_per_hour: float = 0.0
    window_seconds: float = 60.0
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    history: deque = field(default_factory=lambda: deque(maxlen=720))
    _recent: deque = field(default_factory=lambda: deque(maxlen=100_000))

    def record_formats(self, table, chosen: dict[str, str]) -> None:
        """The start-up format measurement (``models.formats.FormatTable``) and each model's choice."""
        if table is not None:
            for fmt, one, eight in table.as_rows():
                self.forward_cost.labels(fmt, "1").set(one)
                self.forward_cost.labels(fmt, "8").set(eight)
        for model, fmt in chosen.items():
            self.weight_format.labels(model, fmt).set(1)

    def __post_init__(self) -> None:
        r = self.registry
        ProcessCollector(registry=r)  # process_resident_memory_bytes and friends: the soak tool reads RSS here
        # status: a finish reason (stop, length, ...), "error" (the engine failed it), "timeout"
        # (--request-timeout), "queue_timeout" (waited --max-queue-wait without starting), or "abort"
        # (the client left, read too slowly, or the server shut down).
        self.requests = Counter("dualserve_requests", "Finished requests", ["decoder", "status"], registry=r)
        self.prompt_tokens = Counter("dualserve_prompt_tokens", "Prompt tokens", ["decoder"], registry=r)
        self.output_tokens = Counter("dualserve_generation_tokens", "Generated tokens", ["decoder"], registry=r)
        self.ttft = Histogram("dualserve_time_to_first_token_seconds", "Time to first token", ["decoder"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("dualserve_inter_token_latency_seconds", "Mean inter-token latency per request",
                             ["decoder"], buckets=LATENCY_BUCKETS, registry=r)
        self.nfe = Histogram("dualserve_forward_passes", "Forward passes (NFE) per request", ["decoder"],
                             buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024), registry=r)
        self.tokens_per_forward = Histogram("dualserve_tokens_per_forward", "Tokens per forward per request",
                                            ["decoder"], buckets=(0.5, 1, 1.5, 2, 2.5, 3, 4, 6, 8, 16, 32),
                                            registry=r)
        self.accept_length = Histogram("dualserve_eagle_accept_length", "Mean EAGLE acceptance length per request",
                                       buckets=(1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 8), registry=r)
        self.rejected = Counter("dualserve_requests_rejected", "Requests refused at admission (429): the waiting "
                                "queue was full (queue_full) or the estimated wait too long (queue_wait)",
                                ["reason"], registry=r)
        self.pool_usage = Gauge("dualserve_kv_pool_usage", "Share of KV blocks in use", registry=r)
        self.pool_blocks = Gauge("dualserve_kv_pool_blocks", "KV blocks in the pool", registry=r)
        self.forward_cost = Gauge("dualserve_forward_gemm_ms", "Start-up estimate of one forward's GEMM time on "
                                  "this host, by weight format and tokens per forward", ["format", "tokens"],
                                  registry=r)
        self.weight_format = Gauge("dualserve_weight_format", "The weight format each model serves in (1)",
                                   ["model", "format"], registry=r)
        self.utilisation = Gauge("dualserve_device_utilisation", "Share of wall time spent in engine steps",
                                 registry=r)
        self.running = Gauge("dualserve_requests_running", "Requests running", registry=r)
        self.waiting = Gauge("dualserve_requests_waiting", "Choices queued and not yet running", registry=r)
        self.capacity = Gauge("dualserve_running_capacity", "Choices the engine lets run now: --max-num-seqs, or the "
                              "running count while the run bound (--max-run-time) holds the next one back",
                              registry=r)
        self.throughput = Gauge("dualserve_throughput_tokens_per_second", "Generated tokens per busy second",
                                ["decoder"], registry=r)
        self.cost = Gauge("dualserve_cost_per_million_tokens", "Effective cost per 1M generated tokens",
                          ["decoder"], registry=r)
        self._busy_mark = (time.monotonic(), 0.0)
        self._util = 0.0  # last computed utilisation, reused between close scrapes

    def observe_request(self, decoder: str, status: str, prompt_tokens: int, output_tokens: int,
                        ttft: float | None, duration: float, stats: dict | None) -> None:
        self.requests.labels(decoder, status).inc()
        self.prompt_tokens.labels(decoder).inc(prompt_tokens)
        self.output_tokens.labels(decoder).inc(output_tokens)
        if ttft is not None:
            self.ttft.labels(decoder).observe(ttft)
            if output_tokens > 1:
                self.itl.labels(decoder).observe((duration - ttft) / (output_tokens - 1))
        stats = stats or {}
        if stats.get("forward_passes"):
            self.nfe.labels(decoder).observe(stats["forward_passes"])
        if stats.get("tokens_per_forward"):
            self.tokens_per_forward.labels(decoder).observe(stats["tokens_per_forward"])
        if stats.get("mean_accept_length"):
            self.accept_length.observe(stats["mean_accept_length"])
        self._recent.append(Sample(time.monotonic(), decoder, output_tokens))

    def refresh(self, engine) -> dict:
        """Sample engine gauges and derived economics; returns a snapshot for the status page."""
        now = time.monotonic()
        state = engine.snapshot()  # decoders.engine.engine.EngineSnapshot
        self.pool_usage.set(state.pool_usage)
        self.pool_blocks.set(state.pool_blocks)
        self.running.set(state.running)
        self.waiting.set(state.waiting)
        self.capacity.set(state.capacity)
        last_at, last_busy = self._busy_mark
        busy = state.busy_seconds
        util = min(1.0, (busy - last_busy) / (now - last_at)) if now - last_at > 0.5 else self._util
        if now - last_at > 0.5:
            self._busy_mark = (now, busy)
        self._util = util
        self.utilisation.set(util)
        while self._recent and now - self._recent[0].at > self.window_seconds:
            self._recent.popleft()
        per_decoder: dict[str, float] = {}
        for s in self._recent:
            per_decoder[s.decoder] = per_decoder.get(s.decoder, 0) + s.tokens
        snapshot = {"t": time.time(), "utilisation": round(util, 4), "pool_usage": round(state.pool_usage, 4),
                    "decoders": {}}
        for decoder, tokens in per_decoder.items():
            # Throughput while busy (tokens per engine-busy second): the node's capacity.
            tps = tokens / self.window_seconds / max(util, 1e-3)
            self.throughput.labels(decoder).set(tps)
            cost = self.cost_per_million(tps, util)
            if cost is not None:
                self.cost.labels(decoder).set(cost)
            snapshot["decoders"][decoder] = {"tokens_per_second": round(tps, 3),
                                             "cost_per_million_tokens": cost}
        if not self.history or snapshot["t"] - self.history[-1]["t"] >= 1.0:
            self.history.append(snapshot)
        return snapshot

    def cost_per_million(self, tokens_per_second: float, utilisation: float) -> float | None:
        """node cost per hour / (throughput x utilisation), per million tokens."""
        if not self.node_cost_per_hour or tokens_per_second <= 0 or utilisation <= 0:
            return None
        per_token = self.node_cost_per_hour / 3600.0 / (tokens_per_second * utilisation)
        return round(per_token * 1e6, 6)

    def render(self, engine) -> bytes:
        self.refresh(engine)
        return generate_latest(self.registry)
