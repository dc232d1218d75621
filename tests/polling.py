"""Waiting in tests for something another thread or process does: ``until`` a condition holds,
and whether a process is ``gone``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable


def until(condition: Callable[[], object], seconds: float = 60.0, every: float = 0.01) -> bool:
    """Whether ``condition()`` holds within ``seconds`` (polled every ``every`` seconds)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(every)
    return bool(condition())


def gone(pid: int) -> bool:
    """Not running: absent, or a zombie no one has reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):  # reaped before the open, or between open and read
        return True
