"""Pure parts of the llama.cpp side-by-side benchmark, its llama.cpp build, and the busy-neighbour
benchmark.

Neither llama.cpp nor a model is started or built here: arguments, commands (cmake, llama-server,
llama-quantize), the build cache and its marker (with cmake stood in for), tables, the output
parser, and the stopping of a started process group (with a stand-in process). One slow test
drives a real llama-server and is skipped where none has been built.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from dualserve.clients import bench_llamacpp as bl
from dualserve.clients import llamacpp_build as lb
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
    assert args.baseline_list == ["cpp"] and args.quantize_list == [] and not args.settle_compare
    assert args.ctx == 1024 and args.llama_server is None
    assert args.cold_sizes == [1000, 3000] and args.cold_requests == 3


def test_options():
    args = bl.parse_args(["--threads", "2", "--requests", "5", "--decoders", "ar, eagle",
                          "--dualserve-args", "--quantization int4 --no-compile", "--concurrency", "4",
                          "--llamacpp-url", "http://h:1/v1", "--dualserve-url", "http://h:2/v1"])
    assert args.threads == 2 and args.requests == 5 and args.decoder_list == ["ar", "eagle"]
    assert args.dualserve_argv == ["--quantization", "int4", "--no-compile"]
    assert args.concurrent_requests == 8
    assert args.llamacpp_url == "http://h:1/v1" and args.dualserve_url == "http://h:2/v1"
    args = bl.parse_args(["--baseline", "cpp, python", "--quantize", "Q4_0,Q4_K_M", "--settle-compare",
                          "--llama-server", "/opt/llama-server", "--ctx", "512"])
    assert args.baseline_list == ["cpp", "python"] and args.quantize_list == ["Q4_0", "Q4_K_M"]
    assert args.settle_compare and args.llama_server == Path("/opt/llama-server") and args.ctx == 512
    args = bl.parse_args(["--cold-tokens", " 500, 6000", "--cold-requests", "5"])
    assert args.cold_sizes == [500, 6000] and args.cold_requests == 5
    assert bl.parse_args(["--cold-tokens", ""]).cold_sizes == []


def test_single_stream_context_holds_the_largest_cold_prompt():
    assert bl.single_stream_ctx(bl.parse_args([])) == 3000 + bl.COLD_CTX_MARGIN
    assert bl.single_stream_ctx(bl.parse_args(["--cold-tokens", ""])) == 1024
    assert bl.single_stream_ctx(bl.parse_args(["--ctx", "8192", "--cold-tokens", "6000"])) == 8192


@pytest.mark.parametrize("argv", [
    ["--decoders", "ar,medusa"], ["--decoders", ","], ["--threads", "0"], ["--requests", "0"],
    ["--concurrency", "-1"], ["--dualserve-args", "'open"], ["--baseline", "rust"], ["--baseline", ","],
    ["--baseline", "cpp,python", "--llamacpp-url", "http://h:1/v1"], ["--ctx", "0"],
    ["--quantize", "Q4_0", "--dualserve-url", "http://h:2/v1"],
    ["--quantize", "Q4_0", "--dualserve-args=--model other.gguf"],
    ["--settle-compare", "--decoders", "eagle"], ["--cold-tokens", "3k"], ["--cold-tokens", "1000,0"],
    ["--cold-requests", "0"]])
def test_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit):
        bl.parse_args(argv)


def test_server_commands_use_the_same_threads():
    ours = bl.dualserve_command(2, 9000, ["--quantization", "int4"])
    assert ours[1:4] == ["-m", "dualserve.server.cli", "serve"]
    assert ours[ours.index("--threads") + 1] == "2" and ours[ours.index("--port") + 1] == "9000"
    assert ours[-2:] == ["--quantization", "int4"]
    py = bl.llama_cpp_python_command(Path("/m.gguf"), 2, 9001, 4096, [])
    assert py[1:3] == ["-m", "llama_cpp.server"]
    assert py[py.index("--model") + 1] == "/m.gguf" and py[py.index("--n_ctx") + 1] == "4096"
    assert py[py.index("--n_threads") + 1] == "2" and py[py.index("--n_threads_batch") + 1] == "2"
    assert py[py.index("--interrupt_requests") + 1] == "False"


def test_llama_server_command_single_stream_and_concurrent():
    one = bl.llama_server_command(Path("/b/llama-server"), Path("/m.gguf"), 2, 9002, 1, 1024)
    assert one == ["/b/llama-server", "-m", "/m.gguf", "-t", "2", "-tb", "2", "-np", "1",
                   "--port", "9002", "--host", "127.0.0.1", "-c", "1024"]
    # llama-server splits -c over its slots: 16 slots of 1024 tokens each
    many = bl.llama_server_command(Path("/b/llama-server"), Path("/m.gguf"), 2, 9003, 16, 1024, ["--mlock"])
    assert many[many.index("-np") + 1] == "16" and many[many.index("-c") + 1] == "16384"
    assert many[-1] == "--mlock"
    args = bl.parse_args(["--threads", "3", "--ctx", "256", "--llamacpp-args=--no-warmup"])
    b = bl.Baseline("cpp", Path("/m.gguf"), lb.Binaries(Path("/b/llama-server")))
    cmd = b.command(args, 9004, 4, args.ctx)
    assert cmd[0] == "/b/llama-server" and cmd[cmd.index("-t") + 1] == "3" and cmd[cmd.index("-c") + 1] == "1024"
    assert cmd[-1] == "--no-warmup" and b.server == "llama-server"
    one = b.command(args, 9004, 1, bl.single_stream_ctx(args))
    assert one[one.index("-c") + 1] == str(3000 + bl.COLD_CTX_MARGIN)  # room for the 3k-token cold prompt
    assert bl.Baseline("python", Path("/m.gguf")).command(args, 9005, 4, 256)[1:3] == ["-m", "llama_cpp.server"]


def test_dualserve_is_given_the_compared_file():
    args = bl.parse_args(["--dualserve-args=--no-compile"])
    assert bl.dualserve_extra(args, Path("/q.gguf")) == ["--model", "/q.gguf", "--no-compile"]
    assert bl.dualserve_extra(args, None) == ["--no-compile"]
    args = bl.parse_args(["--dualserve-args=--model=/x.gguf"])
    assert bl.dualserve_extra(args, Path("/q.gguf")) == ["--model=/x.gguf"]


# ---------------------------------------------------------------------------------------------
# llama.cpp build (clients/llamacpp_build.py), with cmake stood in for


def test_cmake_commands():
    cfg = lb.configure_command(Path("/src/llama.cpp"), Path("/cache/llama.cpp/v-h"))
    assert cfg[:5] == ["cmake", "-S", "/src/llama.cpp", "-B", "/cache/llama.cpp/v-h"]
    for opt in ("-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DCMAKE_BUILD_TYPE=Release",
                "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"):
        assert opt in cfg
    no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    assert f"-DCMAKE_C_FLAGS={no_amx}" in cfg and f"-DCMAKE_CXX_FLAGS={no_amx}" in cfg
    build = lb.build_command(Path("/cache/llama.cpp/v-h"), 2)
    assert build[:3] == ["cmake", "--build", "/cache/llama.cpp/v-h"]
    assert build[build.index("--parallel") + 1] == "2"
    assert build[build.index("--target") + 1:] == ["llama-server", "llama-quantize", "llama-bench"]
    dl = lb.download_command(Path("/cache/llama.cpp/src"))
    assert dl[1:] == ["-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "llama-cpp-python==0.3.36",
                      "-d", "/cache/llama.cpp/src"]


def test_build_dir_is_keyed_by_version_and_cpu_flags(tmp_path):
    flags = lb.cpu_flags("processor\t: 0\nflags\t\t: sse avx2 avx512f fpu\nprocessor\t: 1\n")
    assert flags == ["avx2", "avx512f", "fpu", "sse"]
    d = lb.build_dir(tmp_path, flags)
    assert d.parent == tmp_path / "llama.cpp" and d.name.startswith("0.3.36-") and len(d.name) == len("0.3.36-") + 12
    assert lb.build_dir(tmp_path, ["fpu", "sse", "avx512f", "avx2"]) == d  # order-free
    assert lb.build_dir(tmp_path, ["avx2", "fpu", "sse"]) != d  # another CPU, another build
    assert lb.source_dir(tmp_path) == tmp_path / "llama.cpp/src/llama_cpp_python-0.3.36/vendor/llama.cpp"


def fake_source(cache: Path) -> None:
    src = lb.source_dir(cache)
    src.mkdir(parents=True)
    (src / "CMakeLists.txt").write_text("")


def test_build_writes_its_marker_only_after_success_and_is_reused(tmp_path, monkeypatch):
    fake_source(tmp_path)
    calls: list[list[str]] = []

    def fake_cmake(cmd, log, out, progress=False):
        calls.append(list(cmd))
        if cmd[1] == "--build":
            (Path(cmd[2]) / "bin").mkdir(parents=True, exist_ok=True)
            for t in lb.TARGETS:
                (Path(cmd[2]) / "bin" / t).write_text("")

    monkeypatch.setattr(lb, "run_logged", fake_cmake)
    out = open(os.devnull, "w")
    d = lb.build(tmp_path, 2, out, flags=["avx2"])
    assert d == lb.build_dir(tmp_path, ["avx2"]) and lb.is_built(d)
    assert [c[1] for c in calls] == ["-S", "--build"]
    marker = json.loads((d / lb.MARKER).read_text())
    assert marker["commands"] == calls and marker["binaries"]["llama-server"] == str(d / "bin" / "llama-server")
    assert lb.build(tmp_path, 2, out, flags=["avx2"]) == d and len(calls) == 2  # reused: nothing run
    (d / "bin" / "llama-quantize").unlink()  # a binary gone: built again
    assert not lb.is_built(d)
    lb.build(tmp_path, 2, out, flags=["avx2"])
    assert len(calls) == 4
    out.close()


def test_interrupted_build_leaves_no_marker(tmp_path, monkeypatch):
    fake_source(tmp_path)

    def failing_cmake(cmd, log, out, progress=False):
        if cmd[1] == "--build":
            raise RuntimeError("cmake --build failed with code 2")

    monkeypatch.setattr(lb, "run_logged", failing_cmake)
    with pytest.raises(RuntimeError, match="failed"):
        lb.build(tmp_path, 2, sys.stderr, flags=["avx2"])
    d = lb.build_dir(tmp_path, ["avx2"])
    assert d.is_dir() and not (d / lb.MARKER).exists() and not lb.is_built(d)


def test_run_logged_echoes_progress_and_reports_failure(tmp_path, capsys):
    script = "print('-- configuring'); print('[ 42%] Building CXX object a.o'); print('[100%] Built target x')"
    lb.run_logged([sys.executable, "-c", script], tmp_path / "log", sys.stderr, progress=True)
    err = capsys.readouterr().err
    assert "[ 42%] Building CXX object a.o" in err and "[100%]" in err and "configuring" not in err
    assert "-- configuring" in (tmp_path / "log").read_text()
    with pytest.raises(RuntimeError, match="(?s)code 3.*boom"):
        lb.run_logged([sys.executable, "-c", "print('boom'); raise SystemExit(3)"], tmp_path / "log", sys.stderr)


def test_find_binaries_prefers_the_given_path_then_path(tmp_path, monkeypatch):
    for name in ("llama-server", "llama-quantize"):
        (tmp_path / name).write_text("")
    found = lb.find_binaries(tmp_path / "llama-server", tmp_path / "cache", 2)
    assert found == lb.Binaries(tmp_path / "llama-server", tmp_path / "llama-quantize", None)
    with pytest.raises(SystemExit):
        lb.find_binaries(tmp_path / "missing", tmp_path / "cache", 2)
    monkeypatch.setattr(lb.shutil, "which", lambda name: str(tmp_path / name))
    assert lb.find_binaries(None, tmp_path / "cache", 2).server == tmp_path / "llama-server"


# ---------------------------------------------------------------------------------------------
# Quantized variants, with llama-quantize stood in for


def test_quantize_command_and_cache_path(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    cmd = bl.quantize_command(Path("/b/llama-quantize"), gguf, Path("/o.gguf"), "Q4_K_M", 2)
    assert cmd == ["/b/llama-quantize", "--allow-requantize", str(gguf), "/o.gguf", "Q4_K_M", "2"]
    p = bl.quantized_path(tmp_path / "cache", gguf, "Q4_0")
    assert p.parent == tmp_path / "cache" / "llama.cpp" / "quantized"
    assert p.name.startswith("m-") and p.name.endswith(".Q4_0.gguf")
    gguf.write_bytes(b"GGUF, changed")
    assert bl.quantized_path(tmp_path / "cache", gguf, "Q4_0") != p


def fake_quantize(tmp_path: Path, code: int = 0) -> Path:
    """A stand-in for llama-quantize: --allow-requantize IN OUT TYPE THREADS, copying IN to OUT."""
    exe = tmp_path / f"llama-quantize-{code}"
    exe.write_text(f'#!/bin/sh\ncp "$2" "$3" && echo "$4" >> "$3"\nexit {code}\n')
    exe.chmod(0o755)
    return exe


def test_quantized_file_is_made_once_and_only_whole(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    cache, logs = tmp_path / "cache", tmp_path
    made = bl.quantized_file(fake_quantize(tmp_path), cache, gguf, "Q4_0", 2, logs)
    assert made == bl.quantized_path(cache, gguf, "Q4_0") and made.read_bytes() == b"GGUFQ4_0\n"
    # reused: a failing quantizer is not even run
    assert bl.quantized_file(fake_quantize(tmp_path, 1), cache, gguf, "Q4_0", 2, logs) == made
    with pytest.raises(RuntimeError, match="llama-quantize Q8_0 failed"):
        bl.quantized_file(fake_quantize(tmp_path, 1), cache, gguf, "Q8_0", 2, logs)
    assert not bl.quantized_path(cache, gguf, "Q8_0").exists()
    assert list(made.parent.glob("*.partial")) == []


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


def test_servers_targets_given_urls_without_starting_anything(tmp_path):
    args = bl.parse_args(["--llamacpp-url", "http://a/v1", "--dualserve-url", "http://b/v1"])
    commands: list[list[str]] = []
    with bl.baseline_server(bl.Baseline("cpp", None, url="http://a/v1"), args, 16, 1024, tmp_path, commands) as url:
        assert url == "http://a/v1"
    with bl.dualserve_server(args, None, tmp_path) as url:
        assert url == "http://b/v1"
    assert commands == [] and list(tmp_path.iterdir()) == []


def test_report_names_the_baseline_and_the_settle_ratio():
    settled = bl.SideBySide("ar", level(20.0, 0.05), level(80.0, 0.1))
    unsettled = bl.SideBySide("ar (no settle)", level(18.0, 0.05), level(80.0, 0.1))
    ratio = bl.settle_ratio(settled, unsettled)
    assert ratio == pytest.approx(0.9)
    text = bl.format_report("t", [settled, unsettled], None, base="llama-server", settle_ratio=ratio)
    assert "llama-server tok/s" in text and "llama.cpp" not in text
    assert "no-settle / settle decode tok/s: 0.90x" in text
    assert any(line.startswith("ar (no settle)") for line in text.splitlines())


def cold_side(ms: float, prompt_tokens: int, n: int = 3) -> list[RequestResult]:
    rs = [result(4, 0.0, ms / 1e3, ms / 1e3 + 0.03) for _ in range(n)]
    for r in rs:
        r.prompt_tokens = prompt_tokens
    return rs


def cold_pair(label: str, ours_ms: float, base_ms: float, tokens: int) -> bl.SideBySide:
    o, b = cold_side(ours_ms, tokens), cold_side(base_ms, tokens + 1)
    return bl.SideBySide(label, summarize_level(1, o, 1.0), summarize_level(1, b, 1.0), o, b)


def test_cold_table_ratio_is_baseline_over_ours():
    rows = [bl.ColdRow(1000, cold_pair("cold 1000", 1700, 4100, 1012), cold_pair("warm 1000", 60, 80, 1020)),
            bl.ColdRow(3000, cold_pair("cold 3000", 6900, 17800, 3011), cold_pair("warm 3000", 120, 200, 3019))]
    assert bl.ttft_gain(rows[1].cold) == pytest.approx(17800 / 6900)
    text = bl.format_report("t", [bl.SideBySide("ar", level(20.0, 0.05), level(80.0, 0.1))], None,
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
    record = bl.cold_record(rows[0])
    assert record["ratio"] == pytest.approx(4100 / 1700) and record["prompt_tokens"] == {"ours": 1012, "baseline": 1013}
    assert record["baseline_warm"]["n_requests"] == 3 and record["max_tokens"] == bl.COLD_MAX_TOKENS


def test_cold_table_without_the_target_size_or_a_first_token():
    empty = [RequestResult("p", "code", t_start=0.0, completion_tokens=4, usage_reported=True,
                           finish_reason="length")]
    silent = bl.SideBySide("cold 500", summarize_level(1, empty, 1.0), summarize_level(1, empty, 1.0), empty, empty)
    text = bl.format_report("t", [], None, cold=[bl.ColdRow(500, silent, cold_pair("warm 500", 50, 60, 500))])
    row = next(line for line in text.splitlines() if line.startswith("500 "))
    assert row.split()[7:10] == ["-", "-", "-"]  # no TTFT on either side, no ratio
    assert "target" not in text and "ours cold 500: 1 requests streamed no text (no TTFT)" in text


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


def words(text: str) -> int:
    """A stand-in tokenizer: words and punctuation marks."""
    return len(re.findall(r"\w+|[^\w\s]", text))


def canned_chat_server(name: str, log: list[tuple[str, dict]]):
    """Streams four words to every chat request (logged), lists one model, and counts tokens with ``words``."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self._send("application/json", json.dumps({"object": "list", "data": [
                {"id": name, "object": "model", "created": 0, "owned_by": "test"}]}).encode())

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/tokenize":
                self._send("application/json", json.dumps({"tokens": [0] * words(body["content"])}).encode())
                return
            log.append((name, body))
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
        args = bl.parse_args(["--threads", "2", "--requests", "3", "--decoders", "ar,eagle", "--concurrency", "4",
                              "--concurrent-requests", "5", "--warmup", "0", "--settle", "0", "--cold-tokens", "",
                              "--dualserve-url", ours_url, "--llamacpp-url", base_url])
        report = await bl.run_bench(args, ours_url, [bl.Baseline("cpp", None, url=base_url)], tmp_path)
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
    (run,) = report["baselines"]
    assert run["server"] == "llama-server" and run["commands"] == [] and run["url"] == base_url
    assert [s["decoder"] for s in run["single_stream"]] == ["ar", "eagle"]
    assert run["single_stream"][0]["ours"]["completion_tokens"] == 12
    assert run["aggregate"]["concurrency"] == 4 and run["aggregate"]["baseline"]["n_ok"] == 5
    printed = capsys.readouterr().out
    assert "threads=2" in printed and "aggregate at concurrency 4" in printed and "vs llama-server" in printed


async def test_settle_compare_interleaves_request_by_request(tmp_path, capsys):
    log: list[tuple[str, dict]] = []
    ours, ours_url = canned_chat_server("ours-model", log)
    base, base_url = canned_chat_server("/models/x.gguf", log)
    try:
        args = bl.parse_args(["--requests", "2", "--decoders", "ar", "--concurrency", "0", "--warmup", "0",
                              "--settle", "0.05", "--settle-compare", "--cold-tokens", "", "--dualserve-url", ours_url,
                              "--llamacpp-url", base_url])
        report = await bl.run_bench(args, ours_url, [bl.Baseline("cpp", None, url=base_url)], tmp_path)
    finally:
        for s in (ours, base):
            s.shutdown()
            s.server_close()
    # every dualserve request comes right after a baseline one: base, ours, base, ours, ...
    assert [who for who, _ in log] == ["/models/x.gguf", "ours-model"] * 4
    (run,) = report["baselines"]
    rows = run["single_stream"]
    assert [r["decoder"] for r in rows] == ["ar", "ar (no settle)"]
    assert rows[0]["ours"]["n_requests"] == 2 and rows[1]["ours"]["n_requests"] == 2
    assert rows[0]["baseline"]["n_requests"] == 4 and run["settle_ratio"] is not None
    assert "no-settle / settle" in capsys.readouterr().out


async def test_cold_prompts_alternate_and_are_new_to_every_server(tmp_path, capsys):
    log: list[tuple[str, dict]] = []
    ours, ours_url = canned_chat_server("ours-model", log)
    base, base_url = canned_chat_server("/models/x.gguf", log)
    try:
        args = bl.parse_args(["--requests", "1", "--decoders", "ar", "--concurrency", "0", "--warmup", "1",
                              "--settle", "0", "--cold-tokens", "200,300", "--cold-requests", "2",
                              "--dualserve-url", ours_url, "--llamacpp-url", base_url])
        baselines = [bl.Baseline("cpp", None, url=base_url), bl.Baseline("python", None, url=base_url)]
        report = await bl.run_bench(args, ours_url, baselines, tmp_path)
    finally:
        for s in (ours, base):
            s.shutdown()
            s.server_close()
    cold = [(who, body) for who, body in log if body["max_tokens"] == bl.COLD_MAX_TOKENS]
    # per baseline: 2 sizes x (1 warm-up + 2 prompts cold + 2 prompts warm) x 2 servers
    assert len(cold) == 2 * 2 * 5 * 2
    text = [body["messages"][0]["content"] for _, body in cold]
    first_size = [who for who, _ in cold[2:10]]
    # after the warm-up pair: prompt 0 cold, then warm, ours first; prompt 1 the other way round
    assert first_size == ["ours-model", "/models/x.gguf"] * 2 + ["/models/x.gguf", "ours-model"] * 2
    assert text[4] == text[2] + "\n" + bl.WARM_LINE and text[3] == text[2]
    assert all(body.get("decoder") == ("ar" if who == "ours-model" else None) for who, body in cold)
    ours_cold = [t for (who, _), t in zip(cold, text) if who == "ours-model" and not t.endswith(bl.WARM_LINE)]
    assert len(ours_cold) == len(set(ours_cold)) == 12  # dualserve never sees a cold prompt twice
    assert all(words(t) <= 300 for t in ours_cold)
    for run in report["baselines"]:
        assert [c["size"] for c in run["cold_ttft"]] == [200, 300]
        assert run["cold_ttft"][0]["ours"]["n_requests"] == 2 and run["cold_ttft"][0]["prompt_tokens"]["ours"] == 3
    printed = capsys.readouterr().out
    assert printed.count("cold prompt TTFT") == 2 and "target" not in printed


def installed_llama_server() -> Path | None:
    """llama-server on PATH, or the one llamacpp_build made for this host in the default cache."""
    from dualserve.models.hub import default_cache_dir

    if on_path := shutil.which("llama-server"):
        return Path(on_path)
    d = lb.build_dir(default_cache_dir(), lb.cpu_flags(Path("/proc/cpuinfo").read_text()))
    return d / "bin" / "llama-server" if lb.is_built(d) else None


@pytest.mark.slow
def test_real_llama_server_answers(tmp_path):
    server = installed_llama_server()
    gguf = bl.default_gguf(None)
    if server is None or not gguf.exists():
        pytest.skip("no llama-server built (python -m dualserve.clients.llamacpp_build) or no default GGUF")
    args = bl.parse_args(["--threads", "1", "--ctx", "256", "--startup-timeout", "300"])
    b = bl.Baseline("cpp", gguf, lb.siblings(server))
    commands: list[list[str]] = []
    with bl.baseline_server(b, args, 2, args.ctx, tmp_path, commands) as url:
        body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}).encode()
        req = urllib.request.Request(url + "/chat/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            answer = json.loads(r.read())
    assert answer["usage"]["completion_tokens"] >= 1
    assert commands[0][commands[0].index("-np") + 1] == "2"
