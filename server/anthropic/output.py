"""What the model produced for one message, in Anthropic's terms: blocks, stop reason, usage.

Shared by the whole-message answer (``handler``) and the stream (``stream``), so both say the
same thing about the same tokens:

- a ``tool_use`` block per parsed call, ``input`` an object (llama.cpp's rule: arguments that
  are not a JSON object give ``{}``), at most one under ``disable_parallel_tool_use``;
- ``stop_reason``: ``tool_use`` when a call was made, ``stop_sequence`` (with ``stop_sequence``
  set) when one of the request's stop sequences ended it, ``max_tokens`` when ``max_tokens`` cut
  it, ``model_context_window_exceeded`` when the context's end cut it first, else ``end_turn``;
- ``usage``: ``input_tokens`` are the prompt tokens *not* read from the prefix cache and
  ``cache_read_input_tokens`` those that were; their sum is the prompt, what ``count_tokens``
  answers (Anthropic's definition, which llama.cpp's server follows too).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..errors import APIError, ErrorKind
from ..service import Job
from .protocol import MessagesRequest, StopReason, ToolUseOut, Usage


@dataclass
class Output:
    """The engine's output for one message."""

    text: str = ""                    # all the text, tool calls included, cut before a stop sequence
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: dict[str, Any] | None = None


def tool_use_block(name: str, arguments: str) -> ToolUseOut:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        value = {}
    return ToolUseOut(id=f"toolu_{uuid.uuid4().hex[:24]}", name=name, input=value if isinstance(value, dict) else {})


def limit_calls(body: MessagesRequest, calls: list[ToolUseOut]) -> list[ToolUseOut]:
    choice = body.tool_choice
    return calls[:1] if choice is not None and choice.disable_parallel_tool_use else calls


def matched_stop(tokenizer: Any, out: Output, stops: list[str]) -> str | None:
    """The stop sequence that ended ``out``. The engine stops at the token that completes one and
    emits the text before it, so it begins where the emitted text ends in the decoded tokens;
    among several there, the one that ends first (the engine's rule, ``detokenize.TextStream``)."""
    if not stops or out.finish_reason != "stop":
        return None
    full = tokenizer.decode(out.token_ids, skip_special_tokens=True)
    rest = full[len(out.text):] if full.startswith(out.text) else full
    hits = [(rest.find(s) + len(s), rest.find(s), s) for s in stops if s in rest]
    return min(hits)[2] if hits else None


def stop_of(body: MessagesRequest, job: Job, out: Output, calls: list[ToolUseOut]) -> tuple[StopReason, str | None]:
    """``stop_reason`` and ``stop_sequence``."""
    if out.finish_reason == "abort":  # only the shutdown drain aborts a live request; the SDK retries a 503
        raise APIError(ErrorKind.NO_CAPACITY, "The server is shutting down; retry shortly.", None,
                       "server_shutting_down", headers={"Retry-After": "5"})
    if calls:
        return "tool_use", None
    if out.finish_reason == "length":
        # The handler fits max_tokens to the context; a smaller one in the plan means the context cut it.
        return ("max_tokens" if job.params.max_tokens == body.max_tokens else "model_context_window_exceeded"), None
    stop = matched_stop(job.model.tokenizer, out, body.stop_sequences or [])
    return ("stop_sequence", stop) if stop is not None else ("end_turn", None)


def usage_of(job: Job, out: Output) -> Usage:
    cached = int((out.stats or {}).get("cached_prompt_tokens", 0))  # prefix-cache hits, from the decoder
    return Usage(input_tokens=len(job.prompts[0]) - cached, output_tokens=len(out.token_ids),
                 cache_read_input_tokens=cached)
