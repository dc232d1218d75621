"""Pure parts of the llama.cpp side-by-side benchmark and the busy-neighbour benchmark.

Neither llama.cpp nor a model is started here: arguments, commands, tables, the output parser,
and the stopping of a started process group (with a stand-in process).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from dualserve.clients import bench_llamacpp as bl
from dualserve.clients import bench_neighbour as bn
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


def test_defaults():
    args = bl.parse_args([])
    assert args.decoder_list == ["ar", "eagle", "diffusion"]
    assert args.max_tokens == 64 and args.temperature == 0.0
    assert args.concurrency == 16 and args.concurrent_requests == 32
    assert args.requests == 12
    assert args.dualserve_argv == [] and args.llamacpp_url is None and args.dualserve_url is None
    assert args.prompts.name == "bench.jsonl"


def test_options():
    args = bl.parse_args(["--threads", "2", "--requests", "5", "--decoders", "ar, eagle",
                          "--dualserve-args", "--quantization int4 --no-compile", "--concurrency", "4",
                          "--llamacpp-url", "http://h:1/v1", "--dualserve-url", "http://h:2/v1"])
    assert args.threads == 2 and args.requests == 5 and args.decoder_list == ["ar", "eagle"]
    assert args.dualserve_argv == ["--quantization", "int4", "--no-compile"]
    assert args.concurrent_requests == 8
    assert args.llamacpp_url == "http://h:1/v1" and args.dualserve_url == "http://h:2/v1"


@pytest.mark.parametrize("argv", [["--decoders", "ar,medusa"], ["--decoders", ","], ["--threads", "0"],
                                  ["--requests", "0"], ["--concurrency", "-1"], ["--dualserve-args", "'open"]])
def test_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit):
        bl.parse_args(argv)


def test_server_commands_use_the_same_threads():
    ours = bl.dualserve_command(2, 9000, ["--quantization", "int4"])
    assert ours[1:4] == ["-m", "dualserve.server.cli", "serve"]
    assert ours[ours.index("--threads") + 1] == "2" and ours[ours.index("--port") + 1] == "9000"
    assert ours[-2:] == ["--quantization", "int4"]
    llama = bl.llamacpp_command(Path("/m.gguf"), 2, 9001, [])
    assert llama[1:3] == ["-m", "llama_cpp.server"]
    assert llama[llama.index("--model") + 1] == "/m.gguf"
    assert llama[llama.index("--n_threads") + 1] == "2" and llama[llama.index("--n_threads_batch") + 1] == "2"
    assert llama[llama.index("--interrupt_requests") + 1] == "False"


def test_report_tables():
    single = [bl.SideBySide("ar", level(20.0, 0.05), level(80.0, 0.1)),
              bl.SideBySide("eagle", level(30.0, 0.05), level(60.0, 0.1, error="APIError: boom"))]
    agg = bl.Aggregate(16, agg_level(16, 120.0), agg_level(16, 70.0))
    text = bl.format_report("title", single, agg, ours_c1=20.0, base_c1=70.0)
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
    text = bl.format_report("t", [bl.SideBySide("diffusion", empty, level(50.0, 0.1))], None)
    row = next(line for line in text.splitlines() if line.startswith("diffusion"))
    assert row.split()[4] == "-" and "concurrency" not in text  # ours tok/s missing, no aggregate table


def test_c1_throughput():
    s = bl.SideBySide("ar", level(20.0, 0.0), level(80.0, 0.0))
    # 11 tokens per request, 10 decode gaps of 1/20 s each, no TTFT: 11 tokens / 0.5 s
    assert bl.c1_throughput(s, "ours") == pytest.approx(22.0)
    assert bl.c1_throughput(None, "ours") is None


def test_servers_targets_given_urls_without_starting_anything():
    args = bl.parse_args(["--llamacpp-url", "http://a/v1", "--dualserve-url", "http://b/v1"])
    with bl.servers(args) as urls:
        assert urls == ("http://b/v1", "http://a/v1")


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for whoever adopted it)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


def test_started_server_group_is_stopped(tmp_path):
    child_pid = tmp_path / "child.pid"
    cmd = [sys.executable, "-c", "import pathlib, subprocess, sys, time; "
           "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
           f"pathlib.Path({str(child_pid)!r}).write_text(str(c.pid)); time.sleep(60)"]
    s = bl.start_server("stand-in", cmd, 1, tmp_path)
    deadline = time.monotonic() + 30
    while not child_pid.exists() or not child_pid.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(RuntimeError, match="did not answer"):
        bl.wait_ready(s, timeout=0.2)
    s.stop()
    assert s.proc.poll() is not None
    pid = int(child_pid.read_text())  # the server's own child, in the same session, is stopped too
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid)


def test_wait_ready_reports_an_early_exit(tmp_path):
    s = bl.start_server("stand-in", [sys.executable, "-c", "print('no llama here'); raise SystemExit(3)"], 1, tmp_path)
    with pytest.raises(RuntimeError, match="(?s)exited with code 3.*no llama here"):
        bl.wait_ready(s, timeout=30)


def test_neighbour_parsing_and_summary():
    args = bn.parse_args(["--threads", "2", "--generate-args", "--decoder eagle"])
    cmd = bn.generate_command(args)
    assert cmd[1:4] == ["-m", "dualserve.server.cli", "generate"] and "--chat" in cmd
    assert cmd[cmd.index("--threads") + 1] == "2" and cmd[-2:] == ["--decoder", "eagle"]
    assert "--threads" not in bn.generate_command(bn.parse_args([]))
    out = "loading...\nHello there!\n[64 tokens in 4.00s, 16.0 tok/s, decoder=ar]\n"
    assert bn.parse_result(out) == (64, 4.0)
    with pytest.raises(ValueError):
        bn.parse_result("nothing")
    runs = [bn.Run("alone", 64, 4.0, 9.0), bn.Run("busy", 64, 8.0, 12.0), bn.Run("alone", 64, 2.0, 9.0),
            bn.Run("busy", 64, 16.0, 20.0)]
    s = bn.summarize(runs)
    assert s["alone_tps"] == pytest.approx(24.0) and s["busy_tps"] == pytest.approx(6.0)
    assert s["ratio"] == pytest.approx(0.25)
    assert bn.format_summary(2, 1, s) == ("threads=2  alone 24.0 tok/s  beside 1 busy neighbour(s) 6.0 tok/s  "
                                          "busy/alone 0.25x")


def test_neighbours_are_stopped():
    with bn.neighbours(2) as procs:
        assert all(p.poll() is None for p in procs)
    assert all(p.poll() is not None for p in procs)


def chat_events(words: list[str]) -> bytes:
    def chunk(content: str | None, finish: str | None = None) -> dict:
        return {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
                "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}]}

    usage = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [],
             "usage": {"prompt_tokens": 3, "completion_tokens": len(words), "total_tokens": 3 + len(words)}}
    events = [*(chunk(w) for w in words), chunk(None, "length"), usage]
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def canned_chat_server(name: str, log: list[tuple[str, dict]]):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self._send("application/json", json.dumps({"object": "list", "data": [
                {"id": name, "object": "model", "created": 0, "owned_by": "test"}]}).encode())

        def do_POST(self) -> None:
            log.append((name, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
            self._send("text/event-stream", chat_events(["a", "b", "c", "d"]))

        def _send(self, ctype: str, body: bytes) -> None:
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/v1"


async def test_run_bench_against_canned_servers(tmp_path, capsys):
    log: list[tuple[str, dict]] = []
    ours, ours_url = canned_chat_server("ours-model", log)
    base, base_url = canned_chat_server("/models/x.gguf", log)
    try:
        out = tmp_path / "r.json"
        args = bl.parse_args(["--threads", "2", "--requests", "3", "--decoders", "ar,eagle", "--concurrency", "4",
                              "--concurrent-requests", "5", "--warmup", "0", "--settle", "0", "--json", str(out),
                              "--dualserve-url", ours_url, "--llamacpp-url", base_url])
        report = await bl.run_bench(args, ours_url, base_url)
    finally:
        for s in (ours, base):
            s.shutdown()
            s.server_close()
    single = [(who, body.get("decoder")) for who, body in log[:12]]
    # prompt by prompt, alternating who goes first; the decoder is only sent to dualserve
    assert single[:6] == [("ours-model", "ar"), ("/models/x.gguf", None), ("/models/x.gguf", None),
                          ("ours-model", "ar"), ("ours-model", "ar"), ("/models/x.gguf", None)]
    assert [d for who, d in single[6:] if who == "ours-model"] == ["eagle"] * 3
    assert all(body["max_tokens"] == 64 and body["temperature"] == 0.0 and "messages" in body for _, body in log)
    assert sum(1 for who, _ in log[12:] if who == "ours-model") == 5 and len(log) == 22
    assert [s["decoder"] for s in report["single_stream"]] == ["ar", "eagle"]
    assert report["single_stream"][0]["ours"]["completion_tokens"] == 12
    assert report["aggregate"]["concurrency"] == 4 and report["aggregate"]["llamacpp"]["n_ok"] == 5
    assert json.loads(out.read_text())["threads"] == 2
    printed = capsys.readouterr().out
    assert "threads=2" in printed and "aggregate at concurrency 4" in printed
