"""The llama.cpp side-by-side command (clients/bench_llamacpp.py), its llama.cpp build, and the
busy-neighbour benchmark.

Neither llama.cpp nor a model is started or built here: arguments, the build's commands (cmake),
its cache and its marker (with cmake stood in for), the neighbour's output parser and the stopping
of its processes, and the whole measurement flow against canned servers."""

from __future__ import annotations

import json
import os
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from dualserve.clients import bench_llamacpp as bl
from dualserve.clients import bench_measure as bm
from dualserve.clients import bench_neighbour as bn
from dualserve.clients import bench_servers as bs
from dualserve.clients import llamacpp_build as lb


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
# The busy-neighbour benchmark (clients/bench_neighbour.py)


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


# ---------------------------------------------------------------------------------------------
# The whole comparison against canned servers


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
        report = await bl.run_bench(args, ours_url, [bs.Baseline("cpp", None, url=base_url)], tmp_path)
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
        report = await bl.run_bench(args, ours_url, [bs.Baseline("cpp", None, url=base_url)], tmp_path)
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
        baselines = [bs.Baseline("cpp", None, url=base_url), bs.Baseline("python", None, url=base_url)]
        report = await bl.run_bench(args, ours_url, baselines, tmp_path)
    finally:
        for s in (ours, base):
            s.shutdown()
            s.server_close()
    cold = [(who, body) for who, body in log if body["max_tokens"] == bm.COLD_MAX_TOKENS]
    # per baseline: 2 sizes x (1 warm-up + 2 prompts cold + 2 prompts warm) x 2 servers
    assert len(cold) == 2 * 2 * 5 * 2
    text = [body["messages"][0]["content"] for _, body in cold]
    first_size = [who for who, _ in cold[2:10]]
    # after the warm-up pair: prompt 0 cold, then warm, ours first; prompt 1 the other way round
    assert first_size == ["ours-model", "/models/x.gguf"] * 2 + ["/models/x.gguf", "ours-model"] * 2
    assert text[4] == text[2] + "\n" + bm.WARM_LINE and text[3] == text[2]
    assert all(body.get("decoder") == ("ar" if who == "ours-model" else None) for who, body in cold)
    ours_cold = [t for (who, _), t in zip(cold, text) if who == "ours-model" and not t.endswith(bm.WARM_LINE)]
    assert len(ours_cold) == len(set(ours_cold)) == 12  # dualserve never sees a cold prompt twice
    assert all(words(t) <= 300 for t in ours_cold)
    for run in report["baselines"]:
        assert [c["size"] for c in run["cold_ttft"]] == [200, 300]
        assert run["cold_ttft"][0]["ours"]["n_requests"] == 2 and run["cold_ttft"][0]["prompt_tokens"]["ours"] == 3
    printed = capsys.readouterr().out
    assert printed.count("cold prompt TTFT") == 2 and "target" not in printed
