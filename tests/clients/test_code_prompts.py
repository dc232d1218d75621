"""Prompts of real code (clients/code_prompts.py): sized by a tokenizer function, each one new.

The code is the interpreter's own standard library; the tokenizer is a stand-in that counts words
and punctuation marks, and ``/tokenize`` is answered by a small local HTTP server.
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dualserve.clients import code_prompts as cp

SIZES = (1000, 3000, 6000)


def words(text: str) -> int:
    return len(re.findall(r"\w+|[^\w\s]", text))


def code_lines(text: str) -> list[str]:
    """The excerpt's lines, between the fence's opening and its header line, and the closing fence."""
    body = text.split("```python\n", 1)[1].rsplit("\n```", 1)[0]
    return body.split("\n")[1:]


@pytest.mark.parametrize("size", SIZES)
def test_prompt_fills_its_size_with_whole_lines(size):
    p = cp.code_prompt(size, 0, words)
    assert p.text.endswith("```\n\n" + cp.INSTRUCTION)
    assert 0.9 * size <= words(p.text) <= size
    # one more line of the library would not have fitted
    lib = cp.load_library(cp.library_root())
    at = cp.start_line(lib, size, 0)
    lines = code_lines(p.text)
    header = f"# {p.path}, from line {p.line}"
    assert words(cp.render([header, *lines, lib.lines[at + len(lines)]])) > size
    assert cp.code_prompt(size, 0, words) == p  # chosen without state


def test_header_names_the_file_and_line_it_starts_at():
    for index in range(4):
        p = cp.code_prompt(1000, index, words)
        source = (cp.library_root() / p.path).read_text(encoding="utf-8", errors="replace").splitlines()
        first = code_lines(p.text)[0]
        assert source[p.line - 1] == first and re.match(r"(async def|def|class) ", first)
        assert p.text.startswith(f"```python\n# {p.path}, from line {p.line}\n")


def test_prompts_differ_across_indices_and_sizes():
    starts = {(size, i): cp.start_line(cp.load_library(cp.library_root()), size, i)
              for size in SIZES for i in range(16)}
    assert len(set(starts.values())) == len(starts)
    prompts = [cp.code_prompt(size, i, words) for size in (1000, 3000) for i in range(4)]
    # each begins with its own file and line, so no two share more than the fence as a prefix
    assert len({p.text.splitlines()[1] for p in prompts}) == len(prompts)
    assert len({p.id for p in prompts}) == len(prompts)


def test_server_token_counter_posts_to_tokenize():
    seen: list[tuple[str, dict]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, body))
            data = json.dumps({"tokens": list(range(words(body["content"])))}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        count = cp.server_token_counter(f"http://127.0.0.1:{server.server_address[1]}/v1")
        assert count("def f(x): return x") == 8
    finally:
        server.shutdown()
        server.server_close()
    assert seen == [("/tokenize", {"content": "def f(x): return x"})]
