"""The llama.cpp comparison's figures and tables (clients/bench_report.py), on made-up levels: the
single-stream, aggregate and cold prompt tables, their ratios, and the cold prompt JSON record."""

from __future__ import annotations

import pytest

from dualserve.clients import bench_measure as bm
from dualserve.clients import bench_report as br
from dualserve.clients.bench import RequestResult, summarize_level


def result(tokens: int, start: float, first: float, last: float, error: str | None = None) -> RequestResult:
    times = [start + first + (last - first) * i / max(tokens - 1, 1) for i in range(tokens)]
    return RequestResult("p", "chat", t_start=start, chunk_times=times, completion_tokens=tokens,
                         usage_reported=True, finish_reason="stop", error=error)


def level(tps: float, ttft: float, n: int = 3, tokens: int = 11, error: str | None = None):
    rs = [result(tokens, 0.0, ttft, ttft + (tokens - 1) / tps) for _ in range(n)]
    if error:
        rs.append(RequestResult("p", "chat", t_start=0.0, error=error))
    return summarize_level(1, rs, n * (ttft + (tokens - 1) / tps))


def agg_level(concurrency: int, agg_tps: float, n: int = 32, tokens: int = 11):
    """A level whose aggregate throughput (completion tokens / wall time) is agg_tps."""
    rs = [result(tokens, 0.0, 0.1, 1.0) for _ in range(n)]
    return summarize_level(concurrency, rs, n * tokens / agg_tps)


def test_report_tables():
    single = [bm.SideBySide("ar", level(20.0, 0.05), level(80.0, 0.1)),
              bm.SideBySide("eagle", level(30.0, 0.05), level(60.0, 0.1, error="APIError: boom"))]
    agg = bm.Aggregate(16, agg_level(16, 120.0), agg_level(16, 70.0))
    text = br.format_report("title", single, agg, ours_c1=20.0, base_c1=70.0)
    lines = text.splitlines()
    assert lines[0] == "title"
    ar = next(line for line in lines if line.startswith("ar "))
    assert "20.0" in ar and "80.0" in ar and "0.25x" in ar and "0.50x" in ar  # tok/s ratio, TTFT ratio
    eagle = next(line for line in lines if line.startswith("eagle "))
    assert "3/3 | 3/4" in eagle and "0.50x" in eagle
    assert "llama.cpp beside eagle: 1 failed, first: APIError: boom" in text
    c16 = next(line for line in lines if line.startswith("16 "))
    cells = c16.split()
    assert cells[-3:] == ["1.71x", "6.00x", "1.00x"]  # ours/llama.cpp, ours c16/c1, llama.cpp c16/c1
    header = next(line for line in lines if line.startswith("decoder"))
    # fixed width: every row of the single-stream table is as wide as its header
    assert all(len(line) == len(header) for line in (ar, eagle))


def test_report_without_aggregate_or_data():
    empty = summarize_level(1, [RequestResult("p", "chat", t_start=0.0, error="boom")], 1.0)
    text = br.format_report("t", [bm.SideBySide("diffusion", empty, level(50.0, 0.1))], None)
    row = next(line for line in text.splitlines() if line.startswith("diffusion"))
    assert row.split()[4] == "-" and "concurrency" not in text  # ours tok/s missing, no aggregate table


def test_c1_throughput():
    s = bm.SideBySide("ar", level(20.0, 0.0), level(80.0, 0.0))
    # 11 tokens per request, 10 decode gaps of 1/20 s each, no TTFT: 11 tokens / 0.5 s
    assert br.c1_throughput(s, "ours") == pytest.approx(22.0)
    assert br.c1_throughput(None, "ours") is None


def test_report_names_the_baseline_and_the_settle_ratio():
    settled = bm.SideBySide("ar", level(20.0, 0.05), level(80.0, 0.1))
    unsettled = bm.SideBySide("ar (no settle)", level(18.0, 0.05), level(80.0, 0.1))
    ratio = br.settle_ratio(settled, unsettled)
    assert ratio == pytest.approx(0.9)
    text = br.format_report("t", [settled, unsettled], None, base="llama-server", settle_ratio=ratio)
    assert "llama-server tok/s" in text and "llama.cpp" not in text
    assert "no-settle / settle decode tok/s: 0.90x" in text
    assert any(line.startswith("ar (no settle)") for line in text.splitlines())


def cold_side(ms: float, prompt_tokens: int, n: int = 3) -> list[RequestResult]:
    rs = [result(4, 0.0, ms / 1e3, ms / 1e3 + 0.03) for _ in range(n)]
    for r in rs:
        r.prompt_tokens = prompt_tokens
    return rs


def cold_pair(label: str, ours_ms: float, base_ms: float, tokens: int) -> bm.SideBySide:
    o, b = cold_side(ours_ms, tokens), cold_side(base_ms, tokens + 1)
    return bm.SideBySide(label, summarize_level(1, o, 1.0), summarize_level(1, b, 1.0), o, b)


def test_cold_table_ratio_is_baseline_over_ours():
    rows = [bm.ColdRow(1000, cold_pair("cold 1000", 1700, 4100, 1012), cold_pair("warm 1000", 60, 80, 1020)),
            bm.ColdRow(3000, cold_pair("cold 3000", 6900, 17800, 3011), cold_pair("warm 3000", 120, 200, 3019))]
    assert br.ttft_gain(rows[1].cold) == pytest.approx(17800 / 6900)
    text = br.format_report("t", [bm.SideBySide("ar", level(20.0, 0.05), level(80.0, 0.1))], None,
                            base="llama-server", cold=rows)
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("tokens"))
    assert header.split()[:4] == ["tokens", "ok", "prompt", "tok"] and "llama-server TTFT ms" in header
    assert "ratio = llama-server / ours, above 1: dualserve answers sooner" in text
    row = next(line for line in lines if line.startswith("3000 "))
    # ok, prompt tokens (usage) ours | baseline, TTFT ms, ratio, warm ms, warm ratio
    assert row.split()[1:] == ["3/3", "|", "3/3", "3011", "|", "3012", "6900", "17800", "2.58x", "120", "200",
                               "1.67x"]
    assert len(row) == len(header)
    assert "cold 3000-token TTFT: 2.58x (target >= 1.50x)" in lines
    record = br.cold_record(rows[0])
    assert record["ratio"] == pytest.approx(4100 / 1700) and record["prompt_tokens"] == {"ours": 1012, "baseline": 1013}
    assert record["baseline_warm"]["n_requests"] == 3 and record["max_tokens"] == bm.COLD_MAX_TOKENS


def test_cold_table_without_the_target_size_or_a_first_token():
    empty = [RequestResult("p", "code", t_start=0.0, completion_tokens=4, usage_reported=True,
                           finish_reason="length")]
    silent = bm.SideBySide("cold 500", summarize_level(1, empty, 1.0), summarize_level(1, empty, 1.0), empty, empty)
    text = br.format_report("t", [], None, cold=[bm.ColdRow(500, silent, cold_pair("warm 500", 50, 60, 500))])
    row = next(line for line in text.splitlines() if line.startswith("500 "))
    assert row.split()[7:10] == ["-", "-", "-"]  # no TTFT on either side, no ratio
    assert "target" not in text and "ours cold 500: 1 requests streamed no text (no TTFT)" in text
