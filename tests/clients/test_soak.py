"""The soak tool runs end to end against the test server for a handful of requests (the long
soak is run by hand): fuzzed requests and cut streams are sent, and the report gives statuses,
problems, hangs, the KV pool, the queue and the server's RSS before and after. Overload answers
(a 429, or a stream ended by a ``rate_limit_error`` event) are rejections, not problems."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from dualserve.clients.soak import rejection


def test_soak_reports_statuses_pool_and_rss(server_url: str, tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    done = subprocess.run([sys.executable, "-m", "dualserve.clients.soak", "--url", server_url, "--requests", "16",
                           "--streams", "4", "--minutes", "0", "--seed", "3", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    report = json.loads(out.read_text())
    assert report["sent"] >= 16 and report["disconnects"] == 4  # every 4th request is a stream cut early
    assert sum(sum(s.values()) for s in report["statuses"].values()) == report["sent"]
    assert report["hangs"] == 0 and report["problems"] == 0, done.stdout
    for key in ("kv_pool_usage", "running", "waiting", "rss_mb"):
        assert key in report["before"] and key in report["after"]
    assert report["after"]["running"] == 0 and report["after"]["waiting"] == 0 and report["after"]["kv_pool_usage"] == 0
    assert report["after"]["rss_mb"] > 50
    assert report["rejected"] >= 0 and report["latency_s"]["max"] >= report["latency_s"]["p50"] > 0
    assert done.returncode == 0 and "OK" in done.stdout and "rss_mb" in done.stdout


def test_overload_answers_are_rejections_not_problems() -> None:
    event = (b'data: {"error": {"message": "waited", "type": "rate_limit_error", "param": null, '
             b'"code": "queue_timeout"}}\n\ndata: [DONE]\n\n')
    assert rejection(200, event, streamed=True) == "queue_timeout"
    assert rejection(429, b'{"error": {"message": "busy", "type": "rate_limit_error", "param": null, '
                          b'"code": "server_overloaded"}}', streamed=False) == "server_overloaded"
    assert rejection(200, b'data: {"choices": []}\n\ndata: [DONE]\n\n', streamed=True) is None
    assert rejection(503, b'{"error": {}}', streamed=False) is None
