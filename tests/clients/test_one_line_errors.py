"""Every command names an input mistake in one line and exits 2, never with a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module, argv, says", [
    ("dualserve.clients.bench_forward", ["--model", "/nonexistent/model"], "is neither a local path"),
    ("dualserve.clients.eval_twin", ["--twin", "/nonexistent/twin"], "/nonexistent/twin/config.json: No such file"),
    ("dualserve.server.cli", ["serve", "--model", "/etc/hostname"], "is a file but not a .gguf file"),
    ("dualserve.server.cli", ["pull", "--cache-dir", "/proc/no-such-dir"], "/proc/no-such-dir: No such file"),
    ("dualserve.server.cli", ["serve", "--port", "0", "--router-policy", "/etc/hostname"],
     "--router-policy /etc/hostname: not a JSON file"),
])
def test_an_input_mistake_is_one_line_and_exit_2(module: str, argv: list[str], says: str) -> None:
    done = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stderr.splitlines() if line.strip() and "Warning" not in line]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert says in lines[-1], done.stderr
