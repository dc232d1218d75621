"""A request inside the engine, and the one place committed tokens become output.

A ``Request`` owns its token ids, sampling parameters, block table, seed, random
generator and output sink. Every decoder reports "tokens committed this step"
through ``Request.commit``; that single function applies EOS, stop token ids,
stop strings (via the shared ``TextStream``), max_tokens and logprobs, so the
three decoders cannot disagree on what a client sees. Tokens after a stop are
dropped and never counted in usage. Commit also keeps the per-token state that
must not cost a pass over the sequence: the prompt-plus-output id list and the
penalty counts. Prompt logprobs, when asked for, ride on the first delta.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Callable, TypeVar

import torch

from .blocks import BlockTable
from .detokenize import TextStream
from .grammar import Constraint
from .sampling import PenaltyState, SamplingParams, TokenLogprob, make_generator, request_seed


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FailureKind(enum.Enum):
    """Why the engine finished a request with an error; the server maps each kind to an HTTP status."""

    CAPACITY = "capacity"        # the KV block pool can never hold the request
    BAD_REQUEST = "bad_request"  # the decoder cannot serve what the request asks
    INTERNAL = "internal"        # a decoder or engine step raised
    OVERLOADED = "overloaded"    # it waited longer than the queue timeout without starting


@dataclass
class Delta:
    """What one step produced for one request; the server turns it into OpenAI chunks."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None     # "stop" | "length" | "abort" | "error"
    error: str | None = None             # the message, with finish_reason "error"
    failure: FailureKind = FailureKind.INTERNAL  # what kind of error, when ``error`` is set
    stats: dict | None = None            # decoder statistics, set on the final delta
    # Echo with logprobs: one entry per prompt token (None for the first), on the first delta.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # A pooling decoder's output (decoders/pooling.py): one float32 CPU vector, on the final delta.
    pooled: torch.Tensor | None = None


class DecoderState:
    """Base of a decoder's working state for one request (``Request.decoder_state``): made by
    the decoder's ``step``, dropped on preemption (the request then starts over)."""


class DecoderCounters:
    """Base of a decoder's statistics for one request (``Request.counters``): kept across
    preemption and reported on the final delta."""

    def report(self) -> dict:
        return {}


C = TypeVar("C", bound=DecoderCounters)


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    decoder: str
    stream: TextStream
    eos_token_ids: frozenset[int]
    sink: Callable[[int, Delta], None]  # set by the submitter; called on the engine thread with (index, delta)
    model: str = ""                      # served model name; picks the runner
    index: int = 0                       # choice index for n > 1
    suffix_ids: list[int] = field(default_factory=list)  # fixed right context (diffusion infill)
    output_ids: list[int] = field(default_factory=list)
    table: BlockTable = field(default_factory=BlockTable)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    # Counters every decoder fills in (surfaced as usage extensions and metrics).
    num_forwards: int = 0                # set by the decoder
    num_preemptions: int = 0             # set by the scheduler
    cached_prompt_tokens: int = 0        # prefix-cache hit at first admission, set by the engine
    admitted: bool = False               # set by the engine at first admission
    arrived: float = field(default_factory=time.monotonic)  # submission time; the queue timeout counts from it
    deadline: float | None = None        # promised finish (monotonic), set by the engine at first admission
    counters: DecoderCounters | None = None  # the decoder's own statistics (see ``counters_of``)
    # The request's noise: one seed (``sampling.request_seed``: its seed plus the choice index, fixed at
    # temperature 0 without one, else fresh), which keys each output position's draw
    # (``sampling.keyed_uniform``) and seeds ``generator`` for a decoder's other noise; set at init.
    seed: int = field(default=0, init=False)
    generator: torch.Generator | None = None
    decoder_state: DecoderState | None = None  # private to the request's decoder
    constraint: Constraint | None = None  # grammar state for structured output, set at submit
    # Entry i is the logprob of prompt token i (None for the first); filled by the decoder during
    # prefill when params.prompt_logprobs is set, else None.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Running penalty counts, made on first use by penalty_state and updated by commit.
    penalties: PenaltyState | None = None
    _ids: list[int] = field(default_factory=list, init=False, repr=False)
    _prompt_logprobs_sent: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        self.seed = request_seed(self.params, self.index)
        self.generator = make_generator(self.seed)
        self._ids = self.prompt_ids + self.output_ids
        if self.params.prompt_logprobs and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    @property
    def all_ids(self) -> list[int]:
        """Prompt then output ids. One list, extended by commit, so reading it costs nothing
        per token; callers must not modify it."""
        if len(self._ids) != len(self.prompt_ids) + len(self.output_ids):
            self._ids = self.prompt_ids + self.output_ids  # output_ids was changed directly
        return self._ids

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs are asked for and not all computed: the prompt must be run, not cached."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

    @property
    def uses_prefix_cache(self) -> bool:
        return not self.needs_prompt_logprobs

    def penalty_state(self, vocab: int, device: torch.device | str = "cpu") -> PenaltyState | None:
        """The running penalty state, or None when the request has no penalties."""
        if not self.params.needs_penalties:
            return None
        if self.penalties is None:
            self.penalties = PenaltyState(self.prompt_ids, self.output_ids, vocab, device)
        return self.penalties

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_computed(self) -> int:
        return self.table.num_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output_ids)

    def counters_of(self, kind: type[C]) -> C:
        """The decoder's counters for this request, made on first use."""
        if not isinstance(self.counters, kind):
            self.counters = kind()
        return self.counters

    def decoder_stats(self) -> dict:
        """Per-request decoder statistics (usage extension and metrics)."""
        out: dict = {"decoder": self.decoder, "forward_passes": self.num_forwards,
                     "cached_prompt_tokens": self.cached_prompt_tokens,
                     "preemptions": self.num_preemptions}
        if self.num_forwards:
            out["tokens_per_forward"] = round(len(self.output_ids) / self.num_forwards, 3)
        if self.counters is not None:
            out.update(self.counters.report())
        return out

    def commit(self, token_ids: list[int], logprobs: list[TokenLogprob] | None = None) -> Delta:
        """Append tokens one by one, stopping exactly where the first stop condition says."""
        if self.params.max_tokens == 0:
            # Prefill only: the prompt's KV is written (and cached) by now; what was sampled is dropped.
            token_ids, self.finish_reason = [], "length"
        text: list[str] = []
        kept: list[int] = []
        for tok in token_ids:
            self.output_ids.append(tok)
            self._ids.append(tok)
            kept.append(tok)
            if (tok in self.eos_token_ids and not self.params.ignore_eos) or tok in self.params.stop_token_ids:
                self.finish_reason = "stop"
                break
            text.append(self.stream.push(tok))
            if self.stream.stopped is not None:
                self.finish_reason = "stop"
                break
            if len(self.output_ids) >= self.params.max_tokens:
                self.finish_reason = "length"
                break
        if self.finish_reason is not None and self.stream.stopped is None:
            text.append(self.stream.flush())
        if self.penalties is not None:
            self.penalties.add(kept)
        lps = logprobs[: len(kept)] if logprobs is not None else None
        delta = Delta("".join(text), kept, lps, self.finish_reason)
        if self.prompt_logprobs is not None and not self._prompt_logprobs_sent:
            delta.prompt_logprobs = self.prompt_logprobs
            self._prompt_logprobs_sent = True
        return delta

    def finish(self, reason: str) -> Delta:
        self.finish_reason = self.finish_reason or reason
        tail = self.stream.flush() if reason in ("stop", "length") and self.stream.stopped is None else ""
        return Delta(tail, [], None, self.finish_reason)

    def fail(self, error: str, failure: FailureKind = FailureKind.INTERNAL) -> Delta:
        """The final delta of a request that failed: finish_reason "error", saying why."""
        self.finish_reason = "error"
        return Delta("", [], None, "error", error=error, failure=failure)
