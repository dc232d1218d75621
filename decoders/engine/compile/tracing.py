"""One trace at a time, and how every step graph is traced.

**Tracing runs alone** (``TRACING``). ``torch.export`` in non-strict mode traces by patching
``torch.nn.Module.__call__`` for the whole process: a module that runs on another thread while
an export traces is caught by the tracer and fails. ``aoti_build.build`` exports in its child, where nothing
else runs; ``build_here`` (the child's body, and any export in a serving process) traces under
``TRACING.export()``, which waits for the running step and holds the next ones until the trace
ends. The engine runs each step's model code through ``TRACING.step()``.

``size_oblivious`` is the setting every step graph is traced under (exported or compiled).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.fx.experimental._config  # noqa: F401 - size_oblivious patches it


class TraceGate:
    """Lets one export trace with no module running on any other thread.

    Steps share the gate; an export waits for the steps inside to leave and, from the moment it
    asks, holds new ones back, so a busy engine cannot starve it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._steps = 0          # threads inside ``step``
        self._exporting = False  # an export holds the gate, or waits for the steps to leave

    @contextmanager
    def step(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._exporting)
            self._steps += 1
        try:
            yield
        finally:
            with self._cond:
                self._steps -= 1
                self._cond.notify_all()

    @contextmanager
    def export(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._exporting)
            self._exporting = True
            self._cond.wait_for(lambda: self._steps == 0)
        try:
            yield
        finally:
            with self._cond:
                self._exporting = False
                self._cond.notify_all()


TRACING = TraceGate()  # process-wide, as the patch it guards against


@contextmanager
def size_oblivious() -> Iterator[None]:
    """Trace without specialising sizes of one: PyTorch otherwise compiles a size-1 dim (one
    sequence, one query row) into separate code, and a decode row would not run the code a verify
    row runs (``compiled``'s rows form)."""
    with torch.fx.experimental._config.patch(backed_size_oblivious=True):
        yield
