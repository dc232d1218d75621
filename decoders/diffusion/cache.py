"""Cache strategies for diffusion decoding: what each forward computes and which cached keys/values it reads.

A diffusion request is one sequence ``[prefix | canvas | suffix]`` whose every position owns a
KV slot in the shared block pool (the request's block table, reserved as steps reach them).
Each forward *computes* a contiguous span of positions (the queries, whose keys/values may be
written to their own slots) and *reads* cached keys/values of other positions (the context,
all visible). A strategy is only the rule that picks the span and the context for a step;
the decoder builds the forward from it, so every strategy works with every unmasking policy,
with bidirectional models (LLaDA, Dream) and with block-causal ones (Fast-dLLM v2, twins).

What one step of one request looks at is a ``Frame``: the unit being denoised ``[us, ue)``,
the ``horizon`` its queries may see up to (the sequence end for a bidirectional model, the end
of the unit's attention block for a block-causal one), ``exact_start`` (the start of that
attention block: everything before it is final, so its keys/values, once computed from final
tokens, are *exact* for a block-causal model; 0 for a bidirectional model, where nothing is)
and ``first_row``, the first position whose logits the unit needs or whose keys/values must be
refreshed: ``us - 1`` while position ``us`` is masked and logits are shifted, else ``us``.

Strategies (Fast-dLLM, Wu et al. 2025, arXiv 2505.22618, section 3.2; ``llada/generate.py``):

- ``NoCache``: every step recomputes everything visible. The reference semantics.
- ``ExactCache``: reuse only exact keys/values: the finished attention blocks of a block-causal
  model (Fast-dLLM v2's block cache, arXiv 2509.26328). The forward that follows a
  finished block recomputes that block from its final tokens *and* denoises the next one, so
  storing a block costs no forward of its own. For a bidirectional model it equals ``NoCache``.
- ``PrefixCache``: at a refresh (each unit start, and every ``refresh_every`` steps) compute the
  whole visible span and store it; in between compute ``[first_row, horizon)`` against the
  stored keys/values of ``[0, first_row)``, which are stale for a bidirectional model.
- ``DualCache``: like ``PrefixCache``, but between refreshes compute only the unit and read the
  stale keys/values of both sides, ``[0, first_row)`` and ``[ue, horizon)``; the unit's new
  keys/values overwrite its slots, as Fast-dLLM's ``replace_position`` does. On a block-causal
  model with sub-block units this is Fast-dLLM v2's sub-block cache.

With ``refresh_every=1`` the prefix and dual caches refresh every step: the same tokens as
``NoCache`` (bidirectional) or ``ExactCache`` (block-causal). A dual step whose first query row
lies in a finished block (the shifted row of a block's first position) would let that row see
the stale right context, so it is a refresh instead. Approximate keys/values never leave the
request: only exact ones may be published to the pool's prefix cache (see ``DiffusionDecoder``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class Frame:
    unit: tuple[int, int]   # positions being denoised [us, ue)
    horizon: int            # queries see keys at positions < horizon
    exact_start: int        # keys/values before this position can be exact (block-causal models)
    first_row: int          # first position the unit's forward must compute (see above)


@dataclass(frozen=True)
class Work:
    """One forward of one request: compute ``query`` positions, read ``context`` ranges."""

    query: tuple[int, int]                 # [start, end)
    context: tuple[tuple[int, int], ...]   # cached position ranges, all visible to every query
    store: bool                            # write the queries' keys/values to their pool slots
    refresh: bool = False
    prefill_only: bool = False             # no logits needed: only exact keys/values are built

    @property
    def num_tokens(self) -> int:
        return self.query[1] - self.query[0]

    @property
    def context_len(self) -> int:
        return sum(b - a for a, b in self.context)


@dataclass
class CacheState:
    """Per-request cache bookkeeping, owned by the request's decoder state."""

    exact_upto: int = 0             # keys/values of [0, exact_upto) in the pool are exact
    since_refresh: int | None = None  # forwards since the last refresh; None: nothing stored yet
    refreshed_unit: int = -1        # the last unit whose keys/values were refreshed


def _exact_span(frame: Frame, state: CacheState) -> Work:
    """Compute from the end of the exact keys/values (or the first needed row) to the horizon."""
    start = min(state.exact_upto, frame.first_row)
    return Work((start, frame.horizon), ((0, start),) if start else (), store=True, refresh=True)


@dataclass(frozen=True)
class NoCache:
    def work(self, frame: Frame, state: CacheState, unit_index: int) -> Work:
        return Work((0, frame.horizon), (), store=False, refresh=True)


@dataclass(frozen=True)
class ExactCache:
    def work(self, frame: Frame, state: CacheState, unit_index: int) -> Work:
        return _exact_span(frame, state)


@dataclass(frozen=True)
class PrefixCache:
    refresh_every: int | None = None  # None: refresh once per unit (Fast-dLLM)

    def work(self, frame: Frame, state: CacheState, unit_index: int) -> Work:
        if _needs_refresh(self.refresh_every, state, unit_index):
            return _exact_span(frame, state)
        start = frame.first_row
        return Work((start, frame.horizon), ((0, start),) if start else (), store=True)


@dataclass(frozen=True)
class DualCache:
    refresh_every: int | None = None

    def work(self, frame: Frame, state: CacheState, unit_index: int) -> Work:
        # A query row in a finished block of a block-causal model must not see the stale
        # right context: such a step (only the block's first, shifted) is a refresh instead.
        if _needs_refresh(self.refresh_every, state, unit_index) or frame.first_row < frame.exact_start:
            return _exact_span(frame, state)
        start, end = frame.first_row, frame.unit[1]
        context = tuple(r for r in ((0, start), (end, frame.horizon)) if r[1] > r[0])
        return Work((start, end), context, store=True)


CacheStrategy = Union[NoCache, ExactCache, PrefixCache, DualCache]


def _needs_refresh(every: int | None, state: CacheState, unit_index: int) -> bool:
    if state.since_refresh is None or unit_index != state.refreshed_unit:
        return True
    return every is not None and state.since_refresh >= every


def prefill_chunk(work: Work, frame: Frame, state: CacheState, budget: int, block_size: int) -> Work | None:
    """A budget-sized piece of a long exact span: whole attention blocks before the current one.

    Only spans that start at the end of the exact keys/values of a block-causal model can be
    split (each finished block depends on earlier ones only); returns None when the span
    cannot be split or fits as it is.
    """
    if work.num_tokens <= budget or not work.store or work.query[0] != state.exact_upto:
        return None
    end = min(frame.exact_start, state.exact_upto + budget // block_size * block_size)
    if end <= state.exact_upto:
        return None
    start = state.exact_upto
    return Work((start, end), ((0, start),) if start else (), store=True, prefill_only=True)


def advance(state: CacheState, work: Work, frame: Frame, unit_index: int) -> None:
    """Record what a finished forward left in the pool."""
    if work.store and work.query[0] <= state.exact_upto:
        # Everything before the attention block is final, so what was just stored there is exact.
        reach = frame.exact_start if not work.prefill_only else work.query[1]
        state.exact_upto = max(state.exact_upto, min(reach, work.query[1]))
    if work.prefill_only:
        return
    if work.refresh:
        state.since_refresh = 1
        state.refreshed_unit = unit_index
    elif state.since_refresh is not None:
        state.since_refresh += 1
