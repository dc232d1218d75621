"""Prompts of about N tokens of real code, each one different, for cold time-to-first-token runs.

The code is the running interpreter's own standard library (the ``.py`` files beside ``os.py``,
test folders left out), so it is present wherever Python is, and it is code a user might paste.
All the files, in sorted order and each headed by a ``# path`` line, are read as one stream of
lines. Prompt ``(size, index)`` is the stretch of that stream that starts at a top-level ``def`` or
``class`` line and holds as many whole lines as fit in ``size`` tokens, fenced as Python and followed
by ``INSTRUCTION``.

The start is chosen without state: a per-size offset (a hash of the size) plus ``index`` times a
stride coprime to the number of starts, so two indices of one size never start at the same line,
and two sizes almost never do (the tests check the sizes and indices the benchmark uses). Prompts
that start at different lines differ from their first line on (it names the file and line), so no
server finds one of them in a prefix cache filled by another; only the chat template's opening and
the fence are shared.

Sizes are counted with a ``count_tokens(text) -> int`` function: ``server_token_counter`` asks a
server's llama.cpp-style ``POST /tokenize`` (dualserve and llama-server both answer it), so the
model's own tokenizer decides. The chat template adds its own few tokens on top; a benchmark
reports the count the server saw (``usage.prompt_tokens``).
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
import math
import os
import re
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

INSTRUCTION = "Explain what this code does."
SKIPPED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
_START = re.compile(r"(?:async def|def|class) ")
# Code tokenizes at 2-5 characters a token; the first guess takes 8 a token and grows if too short.
_CHARS_PER_TOKEN_BOUND = 8

TokenCounter = Callable[[str], int]


@dataclass(frozen=True)
class Library:
    """The standard library's source as one stream of lines, and where top-level definitions start."""

    lines: tuple[str, ...]
    starts: tuple[int, ...]  # indices into lines of top-level def / class lines
    file_starts: tuple[int, ...]  # index into lines of each file's "# path" header, ascending
    paths: tuple[str, ...]  # each file's path relative to the library root, in the same order

    def origin(self, at: int) -> tuple[str, int]:
        """The file path and the 1-based line number in it of stream line ``at``."""
        f = bisect.bisect_right(self.file_starts, at) - 1
        return self.paths[f], at - self.file_starts[f]


@dataclass(frozen=True)
class CodePrompt:
    size: int  # the token budget it was cut to
    index: int
    path: str  # where it starts: file (relative to the library root) and line
    line: int
    text: str

    @property
    def id(self) -> str:
        return f"code{self.size}-{self.index} {self.path}:{self.line}"


def library_root() -> Path:
    return Path(os.__file__).parent


def source_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if not SKIPPED_DIRS.intersection(p.relative_to(root).parts))


@functools.cache
def load_library(root: Path) -> Library:
    lines: list[str] = []
    starts: list[int] = []
    file_starts: list[int] = []
    paths: list[str] = []
    for f in source_files(root):
        rel = f.relative_to(root).as_posix()
        file_starts.append(len(lines))
        paths.append(rel)
        lines.append(f"# {rel}")
        for text in f.read_text(encoding="utf-8", errors="replace").splitlines():
            if _START.match(text):
                starts.append(len(lines))
            lines.append(text)
    if not starts:
        raise RuntimeError(f"no Python source with top-level definitions under {root}")
    return Library(tuple(lines), tuple(starts), tuple(file_starts), tuple(paths))


def start_line(lib: Library, size: int, index: int) -> int:
    """The stream line prompt ``(size, index)`` starts at."""
    n = len(lib.starts)
    offset = int(hashlib.sha256(f"code-prompt:{size}".encode()).hexdigest()[:12], 16) % n
    # A stride near n / golden ratio spreads consecutive indices over the whole library; being
    # coprime to n, it gives every index below n its own start.
    stride = max(1, round(n / (1 + math.sqrt(5)) * 2))
    while math.gcd(stride, n) != 1:
        stride += 1
    return lib.starts[(offset + index * stride) % n]


def render(lines: list[str]) -> str:
    return "```python\n" + "\n".join(lines) + "\n```\n\n" + INSTRUCTION


def _lines_from(lib: Library, at: int, chars: int) -> list[str]:
    """Lines from stream line ``at`` on (wrapping at the end) until they hold ``chars`` characters."""
    out: list[str] = []
    total = 0
    while total < chars and len(out) < len(lib.lines):
        text = lib.lines[(at + len(out)) % len(lib.lines)]
        out.append(text)
        total += len(text) + 1
    return out


def code_prompt(size: int, index: int, count_tokens: TokenCounter, root: Path | None = None) -> CodePrompt:
    """Prompt ``(size, index)``: the most whole lines from its start whose rendering counts at most
    ``size`` tokens (at least one line), by bisection over the line count."""
    lib = load_library(root or library_root())
    at = start_line(lib, size, index)
    path, line = lib.origin(at)
    header = f"# {path}, from line {line}"
    chars = size * _CHARS_PER_TOKEN_BOUND
    candidate = _lines_from(lib, at, chars)
    while count_tokens(render([header, *candidate])) <= size and len(candidate) < len(lib.lines):
        chars *= 2
        candidate = _lines_from(lib, at, chars)
    lo, hi = 1, len(candidate)  # lo lines always taken; hi lines are known to be too many
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count_tokens(render([header, *candidate[:mid]])) <= size:
            lo = mid
        else:
            hi = mid
    return CodePrompt(size, index, path, line, render([header, *candidate[:lo]]))


def server_token_counter(base_url: str, timeout: float = 60.0) -> TokenCounter:
    """Token counts from a server's ``POST /tokenize`` (``base_url`` may end in ``/v1``)."""
    root = base_url.rstrip("/").removesuffix("/v1")

    def count(text: str) -> int:
        body = json.dumps({"content": text}).encode()
        req = urllib.request.Request(f"{root}/tokenize", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return len(json.loads(r.read())["tokens"])

    return count
