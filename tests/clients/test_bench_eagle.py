"""bench_eagle's prompt sets and summary (the timed run itself is by hand)."""

from __future__ import annotations

from dualserve.clients.bench import load_prompts
from dualserve.clients.bench_eagle import AGENTIC_PROMPTS, MODES, Row, load_cases, parse_args, summary


def test_agentic_set_is_held_out_and_well_formed() -> None:
    cases = load_cases(AGENTIC_PROMPTS)
    assert 12 <= len(cases) <= 16 and {c.kind for c in cases} == {"json", "code", "tools"}
    assert all(c.messages[-1]["role"] == "user" for c in cases)
    assert any(len(c.messages) > 3 for c in cases if c.kind == "tools")  # multi-turn tool calls
    assert len(load_prompts(AGENTIC_PROMPTS)) == len(cases)  # the held-out filter of training reads it too


def test_summary_ratios_and_identity() -> None:
    rows = [Row("s", "p1", "k", "ar", 10, 1.0, 1.0, 1.0, True), Row("s", "p1", "k", "suffix", 10, 0.5, 3.0, 2.5, True),
            Row("s", "p2", "k", "ar", 20, 2.0, 1.0, 1.0, True), Row("s", "p2", "k", "suffix", 20, 2.0, 1.5, 1.4, False)]
    by_mode = {r["mode"]: r for r in summary(rows)}
    assert by_mode["ar"]["ratio_to_ar"] == 1.0
    assert abs(by_mode["suffix"]["ratio_to_ar"] - 30 / 2.5 / 10) < 1e-9
    assert by_mode["suffix"]["identical"] == 1 and by_mode["suffix"]["accept_length"] == 2.25
    assert by_mode["ar"]["decode_ratio"] == 1.0  # first=0: the decode rate counts tokens after the first


def test_decode_rate_leaves_out_the_first_token() -> None:
    rows = [Row("s", "p1", "k", "ar", 11, 2.0, 1.0, 1.0, True, first=1.0),
            Row("s", "p1", "k", "suffix", 11, 1.5, 2.0, 2.0, True, first=1.0)]
    by_mode = {r["mode"]: r for r in summary(rows)}
    assert by_mode["ar"]["decode_tps"] == 10.0 and by_mode["suffix"]["decode_tps"] == 20.0
    assert by_mode["suffix"]["decode_ratio"] == 2.0 and abs(by_mode["suffix"]["ratio_to_ar"] - 4 / 3) < 1e-9
    assert parse_args([]).modes.split(",") == [m for m in MODES if m != "block"]
    assert parse_args(["--dflash", "d"]).modes.split(",") == list(MODES)
