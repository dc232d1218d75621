"""Failure isolation: a request that raises fails alone, and its batch neighbours go on.

A decoder's step runs one forward for its whole batch, then per-request work (sampling,
grammar, drafting, committing). Two rules keep a failure to the request that caused it:

- **Per-request work is guarded where it runs** (``guard``): an exception there finishes that
  request with finish_reason "error" and the loop moves on to the next request.
- **A step that raises as a whole** (the shared forward, or anything not guarded) cannot name
  its culprit, so ``run_isolated`` retries the batch in halves, leaving out requests that
  already received output or finished in the failed attempt, until the request that fails
  alone is found and failed (bisection: about 2 log2(batch) extra forwards for one bad
  request). A retry is sound because a decoder changes a request's state only after the
  step's shared computations (forwards, the batch's logits) have succeeded, or leaves it
  complete before them (EAGLE's catch-up), and a forward that is run again writes the same
  keys/values into the same slots.
"""

from __future__ import annotations

import logging
from types import TracebackType
from typing import Callable, Sequence

from .request import Delta, FailureKind, Request
from .scheduler import Scheduled

log = logging.getLogger("dualserve.engine")

Emit = Callable[[Request, Delta], None]


def internal_error(e: BaseException) -> str:
    """What a client is told about an exception: its kind, never a traceback."""
    return f"internal error: {type(e).__name__}"


class guard:
    """``with guard(req, emit) as g:`` runs one request's share of a step; if it raises an
    ``Exception``, the request is failed alone (``g.failed`` is then True) and the caller goes on."""

    def __init__(self, req: Request, emit: Emit, what: str = "step"):
        self.req, self.emit, self.what = req, emit, what
        self.failed = False

    def __enter__(self) -> "guard":
        return self

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> bool:
        if e is None or not isinstance(e, Exception):
            return False
        log.error("%s failed for request %s", self.what, self.req.request_id, exc_info=(kind, e, tb))
        self.failed = True
        if not self.req.finished:
            self.emit(self.req, self.req.fail(internal_error(e)))
        return True


def run_isolated(step: Callable[[Sequence[Scheduled], Emit], None], batch: Sequence[Scheduled], emit: Emit,
                 fail: Callable[[Request, FailureKind, str], None]) -> None:
    """Run ``step`` on ``batch``; if it raises, bisect the rest of the batch (see module docstring)."""
    touched: set[int] = set()

    def tracking(req: Request, delta: Delta) -> None:
        touched.add(id(req))
        emit(req, delta)

    try:
        step(batch, tracking)
        return
    except Exception as e:  # noqa: BLE001 - isolated below
        rest = [s for s in batch if not s.request.finished and id(s.request) not in touched]
        if len(batch) == 1:
            log.exception("step failed for request %s", batch[0].request.request_id)
            for s in rest:
                fail(s.request, FailureKind.INTERNAL, internal_error(e))
            return
        log.warning("a step over %d requests failed (%s: %s); retrying %d of them in halves",
                    len(batch), type(e).__name__, e, len(rest))
    half = (len(rest) + 1) // 2
    for part in (rest[:half], rest[half:]):
        if part:
            run_isolated(step, part, emit, fail)
