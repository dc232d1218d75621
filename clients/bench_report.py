"""The llama.cpp comparison's figures and report: ratios drawn from the measured rows (TTFT gain,
settle ratio, c1 throughput), the fixed-width tables printed per baseline, and the JSON records.
"""

from __future__ import annotations

from typing import Sequence

from dualserve.clients.bench import LevelSummary, RequestResult, level_record
from dualserve.clients.bench_measure import COLD_MAX_TOKENS, Aggregate, BaselineRun, ColdRow, SideBySide

COLD_TARGET = (3000, 1.5)  # issue 54: cold 3k-token TTFT at least 1.5x llama-server's


def ttft_gain(s: SideBySide) -> float | None:
    """Baseline TTFT / ours (means over requests): above 1, dualserve reaches the first token sooner."""
    r = s.ratios["ttft"]
    return 1.0 / r if r else None


def prompt_tokens(requests: Sequence[RequestResult]) -> float | None:
    """Mean prompt tokens the server reported (``usage.prompt_tokens``)."""
    counts = [r.prompt_tokens for r in requests if r.ok and r.prompt_tokens is not None]
    return sum(counts) / len(counts) if counts else None


def settle_ratio(settled: SideBySide, unsettled: SideBySide) -> float | None:
    """dualserve's no-settle / settle decode tok/s (pooled over requests)."""
    a, b = _dec(unsettled.ours), _dec(settled.ours)
    return a / b if a is not None and b else None


def c1_throughput(s: SideBySide | None, side: str) -> float | None:
    if s is None:
        return None
    lv = s.ours if side == "ours" else s.base
    return lv.aggregate_tps or None


def _f(x: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _ms(lv: LevelSummary) -> float | None:
    return lv.ttft.mean * 1e3 if lv.ttft else None


def _dec(lv: LevelSummary) -> float | None:
    return lv.pooled_decode_tps


def fixed_width(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    table = [list(header), *map(list, rows)]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]

    def fmt(row: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    return "\n".join([fmt(table[0]), "  ".join("-" * w for w in widths), *map(fmt, table[1:])])


def single_header(base: str) -> tuple[str, ...]:
    return ("decoder", "ok", "ours tok/s", f"{base} tok/s", "ratio", "ours TTFT ms", f"{base} TTFT ms", "TTFT ratio")


def aggregate_header(base: str) -> tuple[str, ...]:
    return ("concurrency", "ok", "ours agg tok/s", f"{base} agg tok/s", "ratio", "ours c/c1", f"{base} c/c1")


def single_rows(rows: Sequence[SideBySide]) -> list[list[str]]:
    out = []
    for s in rows:
        r = s.ratios
        out.append([s.decoder, f"{s.ours.n_ok}/{s.ours.n_requests} | {s.base.n_ok}/{s.base.n_requests}",
                    _f(_dec(s.ours)), _f(_dec(s.base)), _x(r["decode_tps"]),
                    _f(_ms(s.ours), "{:.0f}"), _f(_ms(s.base), "{:.0f}"), _x(r["ttft"])])
    return out


def cold_header(base: str) -> tuple[str, ...]:
    return ("tokens", "ok", "prompt tok", "ours TTFT ms", f"{base} TTFT ms", "ratio",
            "ours warm ms", f"{base} warm ms", "warm ratio")


def cold_rows(rows: Sequence[ColdRow]) -> list[list[str]]:
    out = []
    for row in rows:
        c, w = row.cold, row.warm
        tokens = [_f(prompt_tokens(rs), "{:.0f}") for rs in (c.ours_requests, c.base_requests)]
        out.append([str(row.size), f"{c.ours.n_ok}/{c.ours.n_requests} | {c.base.n_ok}/{c.base.n_requests}",
                    " | ".join(tokens),
                    _f(_ms(c.ours), "{:.0f}"), _f(_ms(c.base), "{:.0f}"), _x(ttft_gain(c)),
                    _f(_ms(w.ours), "{:.0f}"), _f(_ms(w.base), "{:.0f}"), _x(ttft_gain(w))])
    return out


def cold_target_line(rows: Sequence[ColdRow]) -> str | None:
    size, target = COLD_TARGET
    row = next((r for r in rows if r.size == size), None)
    if row is None:
        return None
    return f"cold {size}-token TTFT: {_x(ttft_gain(row.cold))} (target >= {target:.2f}x)"


def aggregate_row(agg: Aggregate, ours_c1: float | None, base_c1: float | None) -> list[str]:
    def div(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    o, b = agg.ours.aggregate_tps, agg.base.aggregate_tps
    return [str(agg.concurrency),
            f"{agg.ours.n_ok}/{agg.ours.n_requests} | {agg.base.n_ok}/{agg.base.n_requests}",
            _f(o), _f(b), _x(div(o, b)), _x(div(o, ours_c1)), _x(div(b, base_c1))]


def _problems(single: Sequence[SideBySide], agg: Aggregate | None, base: str,
              cold: Sequence[ColdRow] = ()) -> list[str]:
    levels = [*((f"ours {s.decoder}", s.ours) for s in single), *((f"{base} beside {s.decoder}", s.base)
                                                                 for s in single)]
    if agg:
        levels += [(f"ours c{agg.concurrency}", agg.ours), (f"{base} c{agg.concurrency}", agg.base)]
    timed_levels = [(f"{who} {s.decoder}", lv) for row in cold for s in (row.cold, row.warm)
                    for who, lv in (("ours", s.ours), (base, s.base))]
    problems = []
    for label, lv in [*levels, *timed_levels]:
        if lv.errors:
            problems.append(f"{label}: {len(lv.errors)} failed, first: {lv.errors[0]}")
        if lv.usage_missing:
            problems.append(f"{label}: {lv.usage_missing} requests without usage (tokens counted as chunks)")
    for label, lv in timed_levels:
        if lv.n_empty:
            problems.append(f"{label}: {lv.n_empty} requests streamed no text (no TTFT)")
    return problems


def format_report(title: str, single: Sequence[SideBySide], agg: Aggregate | None,
                  ours_c1: float | None = None, base_c1: float | None = None, base: str = "llama.cpp",
                  settle_ratio: float | None = None, cold: Sequence[ColdRow] = ()) -> str:
    """The printed report: single-stream table (decode tok/s, TTFT), the aggregate table and the
    cold prompt table."""
    parts = [title, "", f"single stream (decode tok/s pooled: decode tokens / decode seconds over all requests; ratio = ours / {base}; ok = ours | {base}):",
             fixed_width(single_header(base), single_rows(single))]
    if settle_ratio is not None:
        parts.append(f"dualserve ar no-settle / settle decode tok/s: {settle_ratio:.2f}x (target >= 0.90x)")
    if agg is not None:
        parts += ["", f"aggregate at concurrency {agg.concurrency} (completion tokens / wall time; "
                      "c/c1 = aggregate / single-stream ar throughput, TTFT included):",
                  fixed_width(aggregate_header(base), [aggregate_row(agg, ours_c1, base_c1)])]
    if cold:
        parts += ["", f"cold prompt TTFT (a new prompt of real code each request, streamed chat, "
                      f"max_tokens={COLD_MAX_TOKENS}; ms = mean time to the first text chunk; ratio = {base} / ours, "
                      "above 1: dualserve answers sooner; warm = the same prompt plus one line, its prefix cached; "
                      f"prompt tok = usage, ours | {base}):",
                  fixed_width(cold_header(base), cold_rows(cold))]
        if line := cold_target_line(cold):
            parts.append(line)
    if problems := _problems(single, agg, base, cold):
        parts += ["", *problems]
    return "\n".join(parts)


def baseline_record(run: BaselineRun) -> dict:
    """JSON for one baseline: which server, and every single-stream and aggregate figure against it."""
    record: dict = {
        "server": run.server, "url": run.url, "model": run.model,
        "commands": run.commands,
        "single_stream": [
            {"decoder": s.decoder, "ratios": s.ratios,
             "ours": level_record(s.ours, s.ours_requests), "baseline": level_record(s.base, s.base_requests)}
            for s in run.single],
    }
    if run.settle_ratio is not None:
        record["settle_ratio"] = run.settle_ratio
    if run.cold:
        record["cold_ttft"] = [cold_record(row) for row in run.cold]
    agg = run.aggregate
    if agg is not None:
        ar_row = next((s for s in run.single if s.decoder == "ar"), None)
        ours_c1, base_c1 = c1_throughput(ar_row, "ours"), c1_throughput(ar_row, "base")
        record["aggregate"] = {
            "concurrency": agg.concurrency,
            "ours": level_record(agg.ours, agg.ours_requests), "baseline": level_record(agg.base, agg.base_requests),
            "ratio": agg.ours.aggregate_tps / agg.base.aggregate_tps if agg.base.aggregate_tps else None,
            "ours_over_c1": agg.ours.aggregate_tps / ours_c1 if ours_c1 else None,
            "baseline_over_c1": agg.base.aggregate_tps / base_c1 if base_c1 else None,
        }
    return record


def cold_record(row: ColdRow) -> dict:
    """JSON for one cold prompt size: its ratios, prompt tokens and every request, cold and warm."""
    c, w = row.cold, row.warm
    return {"size": row.size, "max_tokens": COLD_MAX_TOKENS, "ratio": ttft_gain(c), "warm_ratio": ttft_gain(w),
            "prompt_tokens": {"ours": prompt_tokens(c.ours_requests), "baseline": prompt_tokens(c.base_requests)},
            "ours": level_record(c.ours, c.ours_requests), "baseline": level_record(c.base, c.base_requests),
            "ours_warm": level_record(w.ours, w.ours_requests),
            "baseline_warm": level_record(w.base, w.base_requests)}
