"""OpenAI's Codex CLI (a Rust binary from npm: ``npm install -g @openai/codex``) pointed at dualserve
as a custom provider with ``wire_api = "responses"``, running one non-interactive prompt.

Skipped, with the reason, where ``codex`` is not on PATH: the package is 420 MB and the project's
own install does not fetch it. Codex sends no temperature or output limit, so the answer is
sampled and its length varies: the test checks that the run completes, not what it says."""

from __future__ import annotations

import shutil

import pytest

pytestmark = pytest.mark.slow


@pytest.mark.skipif(shutil.which("codex") is None, reason="Codex CLI not installed (npm install -g @openai/codex)")
def test_codex_exec_answers_through_the_responses_api(server_url):
    from dualserve.clients.example_codex import run

    done = run("Say hello", f"{server_url}/v1", timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip(), done.stderr[-2000:]
    assert "provider: dualserve" in done.stderr
