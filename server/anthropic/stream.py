"""A streamed /v1/messages answer: Anthropic's typed SSE events, as the engine's deltas arrive.

Each event is ``event: NAME`` then ``data: JSON`` (whose ``type`` is NAME), in the order the
``anthropic`` SDK's ``MessageStream`` accumulates (``lib/streaming/_messages.py``):

    message_start            the message with empty content, stop_reason null, usage so far
    ping                     at once, then whenever PING_INTERVAL_S passes without an event
    content_block_start      index 0, an empty text block, at the first text
    content_block_delta      text_delta ...
    content_block_stop
    content_block_start      per tool call: a tool_use block with input {}
    content_block_delta      input_json_delta: the call's whole input
    content_block_stop
    message_delta            stop_reason, stop_sequence and the usage totals
    message_stop

Tool calls are parsed once the output is complete (``tools.ToolStream`` holds back text that
may open a call), so a call's input arrives as one delta. A failure after the first event is
an ``error`` event in Anthropic's error shape, which ends the stream (the SDK raises it): every
stream ends with ``message_stop`` or ``error``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, TypeVar

from dualserve.decoders.engine.request import Delta

from ..chat import ChatHandler
from ..errors import APIError, ErrorKind, anthropic_error_body
from ..protocol import encoder
from ..service import Job, Service
from ..tools import ToolStream
from .output import Output, limit_calls, stop_of, tool_use_block, usage_of
from .protocol import (BlockDelta, BlockStart, BlockStop, InputJsonDelta, Message, MessageDelta, MessagesRequest,
                       MessageStart, MessageStop, Ping, StopInfo, StreamEvent, TextDelta, TextOut, ToolUseOut, Usage)

log = logging.getLogger("dualserve.server")

# Anthropic pings while a stream is quiet; here that is a long prefill, or a queue ahead of it.
PING_INTERVAL_S = 10.0

T = TypeVar("T")


def sse(event: StreamEvent) -> bytes:
    return b"event: " + event.__struct_config__.tag.encode() + b"\ndata: " + encoder.encode(event) + b"\n\n"


def error_event(err: APIError) -> bytes:
    return b"event: error\ndata: " + encoder.encode(anthropic_error_body(err.status, err.message)) + b"\n\n"


async def with_pings(items: AsyncIterator[T], interval: float) -> AsyncIterator[T | None]:
    """``items``, with a None whenever ``interval`` seconds pass without one. The pending step is
    awaited as a task, never cancelled by a tick; on exit (the client went away) it is cancelled,
    which ends ``items`` through its own ``finally`` (``Service.deltas`` aborts the job there)."""
    it = aiter(items)
    step: asyncio.Future | None = None
    try:
        while True:
            step = asyncio.ensure_future(anext(it))
            while not (await asyncio.wait({step}, timeout=interval))[0]:
                yield None
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if step is not None and not step.done():
            step.cancel()
            await asyncio.wait({step})
        await it.aclose()


class EventStream:
    """One streamed message."""

    def __init__(self, service: Service, body: MessagesRequest, chat: ChatHandler, job: Job):
        self.service = service
        self.body = body
        self.job = job
        self.tools = ToolStream(chat.family) if chat.use_tools else None
        self.out = Output()
        self.calls: list[ToolUseOut] = []
        self.text_open = False

    async def events(self) -> AsyncIterator[bytes]:
        job = self.job
        start = Message(id=f"msg_{job.id}", model=job.model.name, content=[], stop_reason=None, stop_sequence=None,
                        usage=Usage(input_tokens=len(job.prompts[0]), output_tokens=0))
        yield sse(MessageStart(message=start))
        yield sse(Ping())
        try:
            async for item in with_pings(self.service.deltas(job), PING_INTERVAL_S):
                for event in self.on_delta(item[1]) if item is not None else [Ping()]:
                    yield sse(event)
            tail = self.close()
        except APIError as e:
            yield error_event(e)
            return
        except Exception:  # noqa: BLE001 - whatever broke, the client gets an ending
            log.exception("a /v1/messages stream failed")
            yield error_event(APIError(ErrorKind.INTERNAL, "internal server error"))
            return
        for event in tail:
            yield sse(event)

    def on_delta(self, delta: Delta) -> list[StreamEvent]:
        out = self.out
        final = delta.finish_reason is not None
        out.text += delta.text
        out.token_ids += delta.token_ids
        out.stats = delta.stats or out.stats
        text, calls = delta.text, []
        if self.tools is not None:
            chunk, _ = self.tools.feed(delta.text, final)
            text = chunk.content or ""
            calls = [tool_use_block(c.function["name"], c.function["arguments"])
                     for c in chunk.tool_calls or [] if c.function]
        if final:
            out.finish_reason = delta.finish_reason
            self.calls = limit_calls(self.body, calls)
        if not text:
            return []
        events: list[StreamEvent] = [] if self.text_open else [BlockStart(index=0, content_block=TextOut(text=""))]
        self.text_open = True
        return [*events, BlockDelta(index=0, delta=TextDelta(text=text))]

    def close(self) -> list[StreamEvent]:
        """The events after the last delta: the text block's stop, each call's block, the message's end."""
        stop_reason, stop_sequence = stop_of(self.body, self.job, self.out, self.calls)
        events: list[StreamEvent] = [BlockStop(index=0)] if self.text_open else []
        first = len(events)
        for i, call in enumerate(self.calls):
            index = first + i
            events += [BlockStart(index=index, content_block=ToolUseOut(id=call.id, name=call.name, input={})),
                       BlockDelta(index=index, delta=InputJsonDelta(partial_json=encoder.encode(call.input).decode())),
                       BlockStop(index=index)]
        usage = usage_of(self.job, self.out)
        return [*events, MessageDelta(delta=StopInfo(stop_reason=stop_reason, stop_sequence=stop_sequence),
                                      usage=usage), MessageStop()]
