"""bench_tp runs one rank and two on a tiny checkpoint and reports identical greedy output."""

from __future__ import annotations

import json

import pytest

from dualserve.clients import bench_tp
from tiny_twin import write_tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


def test_bench_tp_reports_both_sides(tmp_path, capsys):
    model = write_tiny_llama(tmp_path / "llama")
    bench_tp.main(["--tp", "2", "--decoders", "ar", "--batch", "2", "--max-tokens", "6", "--repeats", "1", "--json",
                   "--model", str(model), "--eagle", "none", "--twin", "none", "--quantization", "none",
                   "--num-blocks", "32", "--threads", "1"])
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (row,) = info["rows"]
    assert row["decoder"] == "ar" and row["identical"] is True
    assert row["tp1_tok_s"] > 0 and row["tp2_tok_s"] > 0
