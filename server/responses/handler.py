"""/v1/responses (OpenAI's Responses API): the handler, its typed stream events, and GET/DELETE by id.

A request is translated into the chat request that serves it (``responses.to_chat``) and
planned by ``ChatHandler``, so routing, hints, the chat template, tools and grammars are the
chat path's. What differs is the output: a ``message`` item with one ``output_text`` part, then
one ``function_call`` item per parsed tool call, ``usage`` as input/output tokens (with the
``dualserve`` extension), and ``status`` ``incomplete`` when ``max_output_tokens`` cut it.

Streaming emits the events the openai SDK's ``client.responses.stream`` accumulates, in its
order: ``response.created``, ``response.in_progress``, then per item ``output_item.added``
(and for the message ``content_part.added``, ``output_text.delta``..., ``output_text.done``,
``content_part.done``; for a call ``function_call_arguments.delta`` and ``.done``) and
``output_item.done``, and last ``response.completed`` (``response.incomplete`` when cut,
``response.failed`` with ``error`` set when the engine fails the request). Tool calls are
parsed once the output is complete, so a call's arguments arrive as one delta.

Finished responses with ``store`` (the default) go to the bounded ``ResponseStore``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from litestar import Response, delete, get
from litestar.datastructures import State

from ..bodies import chat_logprobs
from ..chat import ChatHandler
from ..errors import APIError, ErrorKind, bad_request
from ..protocol import (ChatTokenLogprob, FunctionCallItem, OutputMessage, OutputText, ResponseObject,
                        ResponsesRequest, ResponsesUsage, encoder)
from ..service import ChoiceResult, Job, Plan, Service
from ..tools import ToolStream
from .store import ResponseStore
from .to_chat import chat_request, echo_text_config, input_messages, refuse_unsupported

log = logging.getLogger("dualserve.server")

# Codes of a failed response's ``error``, by what went wrong (the SDK's ResponseError.code values).
FAILURE_CODES = {ErrorKind.OVERLOADED: "rate_limit_exceeded", ErrorKind.INVALID_REQUEST: "invalid_prompt"}


@dataclass(frozen=True)
class Call:
    """One parsed tool call, whichever parser produced it."""

    call_id: str
    name: str
    arguments: str


@dataclass
class Output:
    """What the model produced for one response, as text and calls."""

    text: str = ""
    calls: list[Call] = field(default_factory=list)
    logprobs: list[ChatTokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    output_tokens: int = 0
    stats: dict[str, Any] | None = None

    @property
    def cut(self) -> bool:
        return self.finish_reason == "length"


class ResponsesHandler:
    def __init__(self, service: Service, body: ResponsesRequest, header_decoder: str | None, store: ResponseStore):
        refuse_unsupported(body)
        self.service = service
        self.body = body
        self.store = store
        history = store.get(body.previous_response_id, "previous_response_id").messages \
            if body.previous_response_id else []
        self.messages = [*history, *input_messages(body.input)]
        if not self.messages and not body.instructions:
            raise bad_request("input holds no message to answer", "input", "missing_required_parameter")
        self.chat = ChatHandler(service, chat_request(body, self.messages), header_decoder)
        self.created_at = int(time.time())

    def plan(self) -> Plan:
        return self.chat.plan()

    # ---- output -------------------------------------------------------------------

    def split(self, text: str) -> tuple[str, list[Call]]:
        """Plain text and tool calls, parsed as the chat path parses them."""
        if not self.chat.use_tools:
            return text, []
        content, calls = self.chat.family.parse(text)
        return content, self.limit([Call(c.id, c.function.name, c.function.arguments) for c in calls])

    def limit(self, calls: list[Call]) -> list[Call]:
        return calls[:1] if self.body.parallel_tool_calls is False else calls

    def items(self, job: Job, out: Output) -> list[OutputMessage | FunctionCallItem]:
        items: list[OutputMessage | FunctionCallItem] = []
        if out.text or not out.calls:
            items.append(message_item(job, out.text, out.logprobs, "incomplete" if out.cut else "completed"))
        items += [call_item(job, i, call) for i, call in enumerate(out.calls)]
        return items

    def response_object(self, job: Job, status: str, items: list, out: Output | None = None,
                        error: dict[str, str] | None = None) -> ResponseObject:
        body = self.body
        usage = None
        if out is not None:
            prompt = len(job.prompts[0])
            cached = int((out.stats or {}).get("cached_prompt_tokens", 0))  # prefix-cache hits, from the decoder
            usage = ResponsesUsage(input_tokens=prompt, output_tokens=out.output_tokens,
                                   total_tokens=prompt + out.output_tokens,
                                   input_tokens_details={"cached_tokens": cached, "cache_write_tokens": 0},
                                   output_tokens_details={"reasoning_tokens": 0}, dualserve=out.stats or None)
        return ResponseObject(
            id=f"resp_{job.id}", created_at=self.created_at, model=job.model.name, status=status, output=items,
            error=error, incomplete_details={"reason": "max_output_tokens"} if out is not None and out.cut else None,
            instructions=body.instructions, max_output_tokens=body.max_output_tokens,
            parallel_tool_calls=body.parallel_tool_calls is not False, previous_response_id=body.previous_response_id,
            temperature=body.temperature, top_p=body.top_p, tool_choice=body.tool_choice or "auto",
            tools=body.tools or [], text=echo_text_config(body), store=body.store, truncation=body.truncation or
            "disabled", metadata=body.metadata or {}, user=body.user, usage=usage)

    def finish(self, job: Job, out: Output) -> ResponseObject:
        """The final response object; stored when the request asked for it."""
        status = "incomplete" if out.cut else "completed"
        response = self.response_object(job, status, self.items(job, out), out)
        if self.body.store:
            turn: dict[str, Any] = {"role": "assistant", "content": out.text}
            if out.calls:
                turn["tool_calls"] = [{"id": c.call_id, "type": "function",
                                       "function": {"name": c.name, "arguments": c.arguments}} for c in out.calls]
            self.store.put(response, [*self.messages, turn])
        return response

    def respond(self, job: Job, results: list[ChoiceResult]) -> ResponseObject:
        r = results[0]
        text, calls = self.split(r.text)
        lps: list[ChatTokenLogprob] = []
        if self.chat.body.logprobs:
            lps = chat_logprobs(self.service, job, r.logprobs).content or []
        return self.finish(job, Output(text, calls, lps, r.finish_reason, len(r.token_ids), r.stats))

    def stream(self, job: Job) -> AsyncIterator[bytes]:
        return EventStream(self, job).events()


def message_item(job: Job, text: str, logprobs: list[ChatTokenLogprob], status: str) -> OutputMessage:
    return OutputMessage(id=f"msg_{job.id}", status=status, content=[OutputText(text=text, logprobs=logprobs)])


def call_item(job: Job, index: int, call: Call, status: str = "completed") -> FunctionCallItem:
    return FunctionCallItem(id=f"fc_{job.id}_{index}", call_id=call.call_id, name=call.name,
                            arguments=call.arguments if status == "completed" else "", status=status)


class EventStream:
    """One streamed response: the SSE events, numbered, as the engine's deltas arrive."""

    def __init__(self, handler: ResponsesHandler, job: Job):
        self.handler = handler
        self.job = job
        self.sequence = 0
        self.out = Output()
        self.message_open = False
        self.pending_logprobs: list[ChatTokenLogprob] = []

    def event(self, kind: str, **fields: Any) -> bytes:
        data = encoder.encode({"type": kind, "sequence_number": self.sequence, **fields})
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    async def events(self) -> AsyncIterator[bytes]:
        handler, job = self.handler, self.job
        started = handler.response_object(job, "in_progress", [])
        yield self.event("response.created", response=started)
        yield self.event("response.in_progress", response=started)
        tools = ToolStream(handler.chat.family) if handler.chat.use_tools else None
        want_logprobs = handler.chat.body.logprobs
        try:
            async for _, delta in handler.service.deltas(job):
                final = delta.finish_reason is not None
                self.out.output_tokens += len(delta.token_ids)
                self.out.stats = self.out.stats or delta.stats
                if want_logprobs and delta.logprobs:
                    self.pending_logprobs += chat_logprobs(handler.service, job, delta.logprobs).content or []
                text, calls = delta.text, []
                if tools is not None:
                    chunk, _ = tools.feed(delta.text, final)
                    text = chunk.content or ""
                    calls = [Call(c.id or "", c.function["name"], c.function["arguments"])
                             for c in chunk.tool_calls or [] if c.function]
                for part in self.text_delta(text):
                    yield part
                if final:
                    self.out.finish_reason = delta.finish_reason
                    self.out.calls = handler.limit(calls)
        except APIError as e:
            yield self.failed(e.message, FAILURE_CODES.get(e.kind, "server_error"))
            return
        except Exception:
            log.exception("a /v1/responses stream failed")
            yield self.failed("internal server error", "server_error")
            return
        for part in self.close_items():
            yield part
        response = handler.finish(job, self.out)
        yield self.event("response.incomplete" if self.out.cut else "response.completed", response=response)

    def text_delta(self, text: str) -> list[bytes]:
        if not text:
            return []
        events = self.open_message()
        self.out.text += text
        self.out.logprobs += self.pending_logprobs
        events.append(self.event("response.output_text.delta", item_id=f"msg_{self.job.id}", output_index=0,
                                 content_index=0, delta=text, logprobs=self.pending_logprobs))
        self.pending_logprobs = []
        return events

    def open_message(self) -> list[bytes]:
        if self.message_open:
            return []
        self.message_open = True
        item = message_item(self.job, "", [], "in_progress")
        return [self.event("response.output_item.added", output_index=0, item=item),
                self.event("response.content_part.added", item_id=item.id, output_index=0, content_index=0,
                           part=OutputText(text=""))]

    def close_items(self) -> list[bytes]:
        """The done events of the message (opened empty if nothing else came), then each call's events."""
        out, job = self.out, self.job
        events = [] if out.calls else self.open_message()
        if self.message_open:
            item = message_item(job, out.text, out.logprobs, "incomplete" if out.cut else "completed")
            part = item.content[0]
            events += [self.event("response.output_text.done", item_id=item.id, output_index=0, content_index=0,
                                  text=out.text, logprobs=out.logprobs),
                       self.event("response.content_part.done", item_id=item.id, output_index=0, content_index=0,
                                  part=part),
                       self.event("response.output_item.done", output_index=0, item=item)]
        first = 1 if self.message_open else 0
        for i, call in enumerate(out.calls):
            index = first + i
            item = call_item(job, i, call)
            events += [self.event("response.output_item.added", output_index=index,
                                  item=call_item(job, i, call, "in_progress")),
                       self.event("response.function_call_arguments.delta", item_id=item.id, output_index=index,
                                  delta=call.arguments),
                       self.event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                                  arguments=call.arguments),
                       self.event("response.output_item.done", output_index=index, item=item)]
        return events

    def failed(self, message: str, code: str) -> bytes:
        response = self.handler.response_object(self.job, "failed", [], error={"code": code, "message": message})
        return self.event("response.failed", response=response)


def store_of(state: State) -> ResponseStore:
    return state.app_state.response_store


@get("/v1/responses/{response_id:str}", sync_to_thread=False)
def retrieve_response(state: State, response_id: str) -> Response:
    return Response(content=encoder.encode(store_of(state).get(response_id).body), media_type="application/json")


@delete("/v1/responses/{response_id:str}", status_code=200, sync_to_thread=False)
def delete_response(state: State, response_id: str) -> Response:
    store_of(state).get(response_id)  # a 404 when it is not held
    store_of(state).delete(response_id)
    return Response(content=encoder.encode({"id": response_id, "object": "response", "deleted": True}),
                    media_type="application/json")
