"""The llama.cpp comparison's server processes (clients/bench_servers.py): start commands with the
same threads, given URLs used as they are, and a started process group stopped (with a stand-in
process). One slow test drives a real llama-server and is skipped where none has been built."""

from __future__ import annotations

import json
import shutil
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from dualserve.clients import bench_files as bf
from dualserve.clients import bench_llamacpp as bl
from dualserve.clients import bench_servers as bs
from dualserve.clients import llamacpp_build as lb
from polling import gone, until


def test_server_commands_use_the_same_threads():
    ours = bs.dualserve_command(2, 9000, ["--quantization", "int4"])
    assert ours[1:4] == ["-m", "dualserve.server.cli", "serve"]
    assert ours[ours.index("--threads") + 1] == "2" and ours[ours.index("--port") + 1] == "9000"
    assert ours[-2:] == ["--quantization", "int4"]
    py = bs.llama_cpp_python_command(Path("/m.gguf"), 2, 9001, 4096, [])
    assert py[1:3] == ["-m", "llama_cpp.server"]
    assert py[py.index("--model") + 1] == "/m.gguf" and py[py.index("--n_ctx") + 1] == "4096"
    assert py[py.index("--n_threads") + 1] == "2" and py[py.index("--n_threads_batch") + 1] == "2"
    assert py[py.index("--interrupt_requests") + 1] == "False"


def test_llama_server_command_single_stream_and_concurrent():
    one = bs.llama_server_command(Path("/b/llama-server"), Path("/m.gguf"), 2, 9002, 1, 1024)
    assert one == ["/b/llama-server", "-m", "/m.gguf", "-t", "2", "-tb", "2", "-np", "1",
                   "--port", "9002", "--host", "127.0.0.1", "-c", "1024"]
    # llama-server splits -c over its slots: 16 slots of 1024 tokens each
    many = bs.llama_server_command(Path("/b/llama-server"), Path("/m.gguf"), 2, 9003, 16, 1024, ["--mlock"])
    assert many[many.index("-np") + 1] == "16" and many[many.index("-c") + 1] == "16384"
    assert many[-1] == "--mlock"
    args = bl.parse_args(["--threads", "3", "--ctx", "256", "--llamacpp-args=--no-warmup"])
    b = bs.Baseline("cpp", Path("/m.gguf"), lb.Binaries(Path("/b/llama-server")))
    cmd = b.command(args, 9004, 4, args.ctx)
    assert cmd[0] == "/b/llama-server" and cmd[cmd.index("-t") + 1] == "3" and cmd[cmd.index("-c") + 1] == "1024"
    assert cmd[-1] == "--no-warmup" and b.server == "llama-server"
    one = b.command(args, 9004, 1, bl.single_stream_ctx(args))
    assert one[one.index("-c") + 1] == str(3000 + bl.COLD_CTX_MARGIN)  # room for the 3k-token cold prompt
    assert bs.Baseline("python", Path("/m.gguf")).command(args, 9005, 4, 256)[1:3] == ["-m", "llama_cpp.server"]


def test_dualserve_is_given_the_compared_file():
    args = bl.parse_args(["--dualserve-args=--no-compile"])
    assert bs.dualserve_extra(args, Path("/q.gguf")) == ["--model", "/q.gguf", "--no-compile"]
    assert bs.dualserve_extra(args, None) == ["--no-compile"]
    args = bl.parse_args(["--dualserve-args=--model=/x.gguf"])
    assert bs.dualserve_extra(args, Path("/q.gguf")) == ["--model=/x.gguf"]


def test_servers_targets_given_urls_without_starting_anything(tmp_path):
    args = bl.parse_args(["--llamacpp-url", "http://a/v1", "--dualserve-url", "http://b/v1"])
    commands: list[list[str]] = []
    with bs.baseline_server(bs.Baseline("cpp", None, url="http://a/v1"), args, 16, 1024, tmp_path, commands) as url:
        assert url == "http://a/v1"
    with bs.dualserve_server(args, None, tmp_path) as url:
        assert url == "http://b/v1"
    assert commands == [] and list(tmp_path.iterdir()) == []


def test_started_server_group_is_stopped(tmp_path):
    child_pid = tmp_path / "child.pid"
    cmd = [sys.executable, "-c", "import pathlib, subprocess, sys, time; "
           "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
           f"pathlib.Path({str(child_pid)!r}).write_text(str(c.pid)); time.sleep(60)"]
    s = bs.start_server("stand-in", cmd, 1, tmp_path)
    deadline = time.monotonic() + 30
    while not child_pid.exists() or not child_pid.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(RuntimeError, match="did not answer"):
        bs.wait_ready(s, timeout=0.2)
    s.stop()
    assert s.proc.poll() is not None
    pid = int(child_pid.read_text())  # the server's own child, in the same session, is stopped too
    assert until(lambda: gone(pid), 10)


def test_wait_ready_reports_an_early_exit(tmp_path):
    s = bs.start_server("stand-in", [sys.executable, "-c", "print('no llama here'); raise SystemExit(3)"], 1, tmp_path)
    with pytest.raises(RuntimeError, match="(?s)exited with code 3.*no llama here"):
        bs.wait_ready(s, timeout=30)


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
    gguf = bf.default_gguf(None)
    if server is None or not gguf.exists():
        pytest.skip("no llama-server built (python -m dualserve.clients.llamacpp_build) or no default GGUF")
    args = bl.parse_args(["--threads", "1", "--ctx", "256", "--startup-timeout", "300"])
    b = bs.Baseline("cpp", gguf, lb.siblings(server))
    commands: list[list[str]] = []
    with bs.baseline_server(b, args, 2, args.ctx, tmp_path, commands) as url:
        body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}).encode()
        req = urllib.request.Request(url + "/chat/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            answer = json.loads(r.read())
    assert answer["usage"]["completion_tokens"] >= 1
    assert commands[0][commands[0].index("-np") + 1] == "2"
