"""The mixed-workload benchmark against the real server: every class answered, auto's choices recorded."""

from __future__ import annotations

import argparse
import asyncio

from dualserve.clients import bench_mixed


def test_mixed_workload_runs_through_auto_and_forced(server_url: str, monkeypatch) -> None:
    args = argparse.Namespace(base_url=f"{server_url}/v1", api_key="unused", model=None, prompts=None, duration=3.0,
                              interactive_rate=1.0, high_value_rate=1.0, batch_rate=1.0, seed=1,
                              policies="auto,ar")
    for cls in bench_mixed.CLASSES.values():
        monkeypatch.setitem(cls, "max_tokens", 4)
    out = asyncio.run(bench_mixed.main_async(args))
    assert set(out) == {"auto", "ar"}
    for policy, classes in out.items():
        for cls, row in classes.items():
            assert row["errors"] == 0, (policy, cls, row)
            if row["requests"]:
                assert row["tokens_per_s"] > 0
    assert all(set(row["decoders"]) <= {"ar"} for row in out["ar"].values())
    assert sum(sum(row["decoders"].values()) for row in out["auto"].values()) == \
        sum(row["requests"] for row in out["auto"].values())
