"""Pure parts of the load client: statistics, per-request metrics, table formatting, prompt loading.

No server is started here: the streaming path runs against canned SSE bodies through
httpx.MockTransport; streaming against a live server is covered by end-to-end tests.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest
from openai import AsyncOpenAI

from dualserve.clients.bench import (
    COLUMNS,
    DEFAULT_PROMPTS,
    BenchSpec,
    Prompt,
    RequestResult,
    Stats,
    format_plain,
    interleave_kinds,
    main_async,
    level_record,
    level_row,
    load_prompts,
    parse_args,
    percentile,
    ratio_lines,
    ratios,
    run_level,
    summarize_level,
)


def make_result(start: float, times: list[float], tokens: int | None, error: str | None = None) -> RequestResult:
    return RequestResult(
        "p", "chat", t_start=start, chunk_times=times, completion_tokens=tokens,
        usage_reported=tokens is not None, error=error,
    )


@pytest.mark.parametrize("q", [0, 10, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear(q):
    xs = [5.0, 1.0, 9.0, 3.0, 7.5, 2.0, 2.0]
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_percentile_rejects_empty():
    with pytest.raises(ValueError):
        percentile([], 50)
    assert Stats.of([]) is None


def test_request_metrics_use_usage_tokens_not_chunks():
    # Three chunks, but the server reports 9 tokens: a speculative decoder streamed several per chunk.
    r = make_result(10.0, [10.5, 11.0, 12.5], tokens=9)
    assert r.ttft == pytest.approx(0.5)
    assert r.tokens == 9
    assert r.tpot == pytest.approx(2.0 / 8)
    assert r.decode_tps == pytest.approx(4.0)
    assert r.gaps == pytest.approx([0.5, 1.5])


def test_request_without_usage_falls_back_to_chunk_count():
    r = make_result(0.0, [0.1, 0.2, 0.3, 0.4], tokens=None)
    assert r.tokens == 4 and not r.usage_reported
    assert r.decode_tps == pytest.approx(10.0)


def test_single_token_request_has_no_decode_rate():
    r = make_result(0.0, [0.2], tokens=1)
    assert r.ok and r.tpot is None and r.decode_tps is None


def test_summarize_level_aggregates_and_skips_failures():
    results = [
        make_result(0.0, [0.1, 0.2, 0.3], tokens=3),
        make_result(0.0, [0.3, 0.5, 0.7], tokens=3),
        make_result(0.0, [], tokens=None, error="APIConnectionError: refused"),
    ]
    lv = summarize_level(2, results, wall_s=1.5)
    assert (lv.n_requests, lv.n_ok, lv.completion_tokens) == (3, 2, 6)
    assert lv.aggregate_tps == pytest.approx(4.0)
    assert lv.ttft.mean == pytest.approx(0.2)
    assert lv.itl.n == 4 and lv.itl.mean == pytest.approx(0.15)
    assert lv.decode_tps.mean == pytest.approx((10.0 + 5.0) / 2)
    assert lv.pooled_decode_tps == pytest.approx((2 + 2) / (0.2 + 0.4))  # decode tokens / decode seconds
    assert lv.errors == ["APIConnectionError: refused"]
    assert lv.usage_missing == 0


def test_ratios_and_their_text():
    ours = summarize_level(1, [make_result(0.0, [0.1, 0.2, 0.3], tokens=3)], wall_s=0.3)
    base = summarize_level(1, [make_result(0.0, [0.2, 0.4, 0.6], tokens=3)], wall_s=0.6)
    r = ratios(ours, base)
    assert r["decode_tps"] == pytest.approx(2.0)
    assert r["aggregate_tps"] == pytest.approx(2.0)
    assert r["ttft"] == pytest.approx(0.5)
    assert r["tpot"] == pytest.approx(0.5)
    assert ratio_lines(r)[0] == "decode tok/s (higher is better): 2.00x"
    empty = summarize_level(1, [], wall_s=0.0)
    assert ratios(ours, empty)["decode_tps"] is None


def test_level_row_and_plain_table():
    lv = summarize_level(4, [make_result(0.0, [0.1, 0.2, 0.3], tokens=3)], wall_s=0.5)
    row = level_row("ours", lv)
    assert len(row) == len(COLUMNS)
    assert row[:4] == ["ours", "4", "1/1", "100.0"]
    assert row[-2:] == ["10.0", "6.0"]
    failed = level_row("baseline", summarize_level(1, [make_result(0.0, [], None, "boom")], wall_s=1.0))
    assert failed[3] == "-" and failed[-2] == "-"
    lines = format_plain([row, failed]).splitlines()
    assert len(lines) == 4
    assert len({len(line) for line in lines}) == 1  # every line padded to the same width
    assert lines[0].split()[0] == "server" and lines[2].startswith("ours")


def test_default_prompt_set_is_large_and_varied():
    prompts = load_prompts()
    assert len(prompts) >= 60
    assert len({p.id for p in prompts}) == len(prompts)
    kinds = Counter(p.kind for p in prompts)
    assert set(kinds) == {"chat", "code", "json_extraction", "summarisation", "factual", "arithmetic"}
    assert min(kinds.values()) >= 8
    assert all(p.prompt.strip() for p in prompts)
    assert DEFAULT_PROMPTS.name == "bench.jsonl"


def test_interleave_kinds_round_robin():
    prompts = [Prompt(f"{k}{i}", k, "x") for k, n in (("a", 3), ("b", 1), ("c", 2)) for i in range(n)]
    assert [p.id for p in interleave_kinds(prompts)] == ["a0", "b0", "c0", "a1", "c1", "a2"]


def test_load_prompts_validates(tmp_path):
    good = tmp_path / "ok.jsonl"
    good.write_text(json.dumps({"id": "a", "kind": "chat", "prompt": "hi"}) + "\n\n")
    assert [p.id for p in load_prompts(good)] == ["a"]
    missing = tmp_path / "missing.jsonl"
    missing.write_text(json.dumps({"id": "a", "prompt": "hi"}) + "\n")
    with pytest.raises(ValueError, match="kind"):
        load_prompts(missing)
    dup = tmp_path / "dup.jsonl"
    dup.write_text((json.dumps({"id": "a", "kind": "x", "prompt": "y"}) + "\n") * 2)
    with pytest.raises(ValueError, match="duplicate"):
        load_prompts(dup)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="no prompts"):
        load_prompts(empty)


def test_parse_args_levels():
    args = parse_args(["--concurrency", "1, 8", "--decoder", "eagle", "--endpoint", "chat"])
    assert args.levels == [1, 8] and args.decoder == "eagle" and args.endpoint == "chat"
    assert args.max_tokens == 128 and args.temperature == 0.0
    with pytest.raises(SystemExit):
        parse_args(["--concurrency", "0"])
    with pytest.raises(SystemExit):
        parse_args(["--concurrency", "a,b"])


def sse(*events: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def completion_chunk(text: str, finish: str | None = None) -> dict:
    choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    return {"id": "c", "object": "text_completion", "created": 0, "model": "m", "choices": [choice]}


USAGE_5 = {**completion_chunk(""), "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}}
TWO_CHUNKS = (completion_chunk("Hello"), completion_chunk(" world, again"), completion_chunk("", "length"), USAGE_5)


def fake_client(seen: list[dict], events: tuple[dict, ...] = TWO_CHUNKS) -> AsyncOpenAI:
    """A client whose server streams `events` (default: two text chunks, a final chunk, usage of 5 tokens)."""

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, content=sse(*events), headers={"content-type": "text/event-stream"})

    http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return AsyncOpenAI(base_url="http://fake/v1", api_key="x", http_client=http, max_retries=0)


async def test_run_level_streams_and_counts_usage_tokens():
    seen: list[dict] = []
    spec = BenchSpec(model="m", endpoint="completions", max_tokens=5, temperature=0.0, decoder="eagle")
    prompts = [Prompt("a", "chat", "hi"), Prompt("b", "code", "def")]
    summary, results = await run_level(fake_client(seen), spec, prompts, concurrency=2, n_requests=3)
    assert sorted(body["prompt"] for body in seen) == ["def", "hi", "hi"]
    assert [r.prompt_id for r in results] == ["a", "b", "a"]
    assert all(body["decoder"] == "eagle" for body in seen)
    assert seen[0]["temperature"] == 0.0 and seen[0]["stream"]
    assert seen[0]["stream_options"] == {"include_usage": True}
    assert summary.n_ok == 3 and summary.completion_tokens == 15 and summary.usage_missing == 0
    r = results[0]
    assert r.text == "Hello world, again" and r.finish_reason == "length" and len(r.chunk_times) == 2
    record = level_record(summary, results)
    json.dumps(record)
    assert record["requests"][0]["tokens"] == 5 and record["requests"][0]["t_start"] >= 0


async def test_failed_request_is_recorded_not_raised():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(500, json={"error": {"message": "boom"}})

    http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    client = AsyncOpenAI(base_url="http://fake/v1", api_key="x", http_client=http, max_retries=0)
    spec = BenchSpec(model="m", endpoint="chat", max_tokens=4, temperature=0.0, decoder=None)
    summary, results = await run_level(client, spec, [Prompt("a", "chat", "hi")], concurrency=1, n_requests=1)
    assert summary.n_ok == 0 and "InternalServerError" in summary.errors[0]
    assert level_row("ours", summary)[3] == "-"


async def test_truncated_and_empty_streams():
    spec = BenchSpec(model="m", endpoint="completions", max_tokens=5, temperature=0.0, decoder=None)
    prompts = [Prompt("a", "chat", "hi")]
    cut = (completion_chunk("Hel"),)  # the server dropped the stream: no finish_reason, no usage
    summary, _ = await run_level(fake_client([], cut), spec, prompts, concurrency=1, n_requests=1)
    assert summary.n_ok == 0 and summary.errors == ["stream ended without a finish_reason"]
    eos_first = (completion_chunk("", "stop"), {**USAGE_5, "usage": {**USAGE_5["usage"], "completion_tokens": 0}})
    summary, results = await run_level(fake_client([], eos_first), spec, prompts, concurrency=1, n_requests=1)
    assert summary.n_ok == 1 and summary.n_empty == 1 and summary.ttft is None
    assert results[0].tokens == 0 and results[0].decode_tps is None


class CannedServer(BaseHTTPRequestHandler):
    """Minimal OpenAI-style server: lists one model, streams TWO_CHUNKS for any completion."""

    def do_GET(self) -> None:
        self._send(b"application/json", json.dumps({"object": "list", "data": [
            {"id": "canned", "object": "model", "created": 0, "owned_by": "test"}]}).encode())

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self._send(b"text/event-stream", sse(*TWO_CHUNKS))

    def _send(self, ctype: bytes, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", ctype.decode())
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:  # keep test output clean
        pass


@pytest.fixture
def canned_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), CannedServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


async def test_cli_with_baseline_writes_json_and_table(canned_url, tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = parse_args([
        "--base-url", canned_url, "--baseline-url", canned_url, "--concurrency", "2",
        "--requests", "3", "--endpoint", "completions", "--json", str(out),
    ])
    report = await main_async(args)
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 2]  # level 1 added for the ratios
    assert report["server"]["model"] == "canned" and report["baseline"]["level"]["n_ok"] == 3
    assert report["ratios"]["decode_tps"] is not None
    assert json.loads(out.read_text())["levels"][1]["completion_tokens"] == 15
    printed = capsys.readouterr().out
    assert "baseline" in printed and "decode tok/s (higher is better)" in printed


def test_a_server_that_has_answered_before_says_how_often(server_url: str) -> None:
    """``bench_llamacpp --dualserve-url`` warns when the server has answered requests already (its
    suffix cache would copy them): the count is the server's own, and 0 where none answers."""
    from openai import OpenAI

    from dualserve.clients.bench import answered_before

    before = answered_before(f"{server_url}/v1")
    OpenAI(base_url=f"{server_url}/v1", api_key="x").completions.create(
        model="SmolLM2-135M-Instruct", prompt="Counting: one, two,", max_tokens=2, temperature=0)
    deadline = time.monotonic() + 5  # counted as the request finishes, which may trail the response
    while answered_before(f"{server_url}/v1") < before + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert answered_before(f"{server_url}/v1") >= before + 1
    assert answered_before("http://127.0.0.1:9/v1") == 0
