"""OpenAI's Codex CLI against dualserve: a custom provider with ``wire_api = "responses"``, one
non-interactive prompt (``codex exec``).

    npm install -g @openai/codex        # or: npm install --prefix DIR @openai/codex
    python -m dualserve.clients.example_codex --base-url http://127.0.0.1:8000/v1 "Say hello"

The configuration is written to a fresh ``CODEX_HOME`` so the user's own is left alone. Codex's
own system prompt (about 5,000 tokens) fits the default model's 8,192-token context but takes
minutes to prefill on a CPU, so ``--short-instructions`` (the default) replaces it with one line.
Its built-in web search and sub-agent tools are turned off: dualserve serves function tools only
and refuses built-in ones with a 400. Codex sends no temperature or output limit, so the model
samples at temperature 1 until it stops.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

MODEL = "SmolLM2-135M-Instruct"
SHORT_INSTRUCTIONS = "You are a helpful assistant. Answer briefly, in plain text."


def config_toml(base_url: str, model: str, instructions_file: Path | None) -> str:
    lines = [f'model = "{model}"', 'model_provider = "dualserve"', 'web_search = "disabled"',
             "model_context_window = 8192"]
    if instructions_file is not None:
        lines.append(f'model_instructions_file = "{instructions_file}"')
    lines += ["", "[agents]", "enabled = false", "", "[features]", "goals = false", "image_generation = false",
              "view_image = false", "", "[model_providers.dualserve]", 'name = "dualserve"',
              f'base_url = "{base_url}"', 'wire_api = "responses"', "stream_max_retries = 0",
              "request_max_retries = 0"]
    return "\n".join(lines) + "\n"


def run(prompt: str, base_url: str, model: str = MODEL, codex: str = "codex", short_instructions: bool = True,
        timeout: float = 600.0) -> subprocess.CompletedProcess:
    """Run ``codex exec PROMPT`` against dualserve; the last line of stdout is the model's answer."""
    binary = shutil.which(codex) or codex
    with tempfile.TemporaryDirectory(prefix="codex-home-") as home, tempfile.TemporaryDirectory() as workdir:
        instructions = None
        if short_instructions:
            instructions = Path(home) / "instructions.md"
            instructions.write_text(SHORT_INSTRUCTIONS + "\n")
        (Path(home) / "config.toml").write_text(config_toml(base_url, model, instructions))
        args = [binary, "exec", "--skip-git-repo-check", "--sandbox", "read-only", prompt]
        env = {"CODEX_HOME": home, "HOME": home, "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        # Its own session: the npm launcher starts the native binary as a child, and a timeout ends both.
        proc = subprocess.Popen(args, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
        return subprocess.CompletedProcess(args, proc.returncode, out, err)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt", nargs="?", default="Say hello")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--codex", default="codex", help="the codex binary")
    parser.add_argument("--full-instructions", action="store_true", help="keep Codex's own system prompt")
    args = parser.parse_args()
    done = run(args.prompt, args.base_url, args.model, args.codex, not args.full_instructions)
    print(done.stdout or done.stderr)
