"""/v1/messages and /v1/messages/count_tokens: the handler and the routes.

A request is translated into the chat request that serves it (``anthropic.to_chat``) and planned
by ``ChatHandler``, so routing, hints, the chat template, tools, grammars, stop strings and the
prefix cache are the chat path's; ``anthropic.output`` turns what the engine produced into
Anthropic's blocks, stop reason and usage, and ``anthropic.stream`` into its typed events.

``max_tokens`` is required, as Anthropic requires it, and is fitted to the context left after
the prompt: a request whose ``max_tokens`` reaches past the context is served to the context's
end and stops with ``model_context_window_exceeded``, as Anthropic's API does for its current
models, rather than refused (Claude Code asks for 32000 whatever the model). A prompt that fills
the context is a 400 "prompt is too long", Anthropic's wording, which Claude Code reads.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from litestar import Request, Response, post
from litestar.datastructures import State
from litestar.response import Stream

from ..chat import ChatHandler
from ..endpoint import decode, generate, json_response
from ..errors import bad_request
from ..protocol import DECODER_HEADER
from ..service import ChoiceResult, Job, Plan, Service
from .output import Output, limit_calls, stop_of, tool_use_block, usage_of
from .protocol import Message, MessagesRequest, TextOut, TokenCount, ToolUseOut, count_decoder, messages_decoder
from .stream import EventStream
from .to_chat import chat_request


class MessagesHandler:
    def __init__(self, service: Service, body: MessagesRequest, header_decoder: str | None):
        self.service = service
        self.body = body
        self.chat = ChatHandler(service, chat_request(body), header_decoder)

    def plan(self) -> Plan:
        ids = self.chat.prompt_ids()
        context = self.chat.model.max_model_len
        if len(ids) >= context:
            raise bad_request(f"prompt is too long: {len(ids)} tokens > {context - 1} maximum", "messages",
                              "context_length_exceeded")
        if self.body.max_tokens < 1:
            raise bad_request("max_tokens: must be at least 1", "max_tokens", "invalid_value")
        self.chat.body.max_tokens = min(self.body.max_tokens, context - len(ids))
        return self.chat.plan_for(ids)

    def split(self, text: str) -> tuple[str, list[ToolUseOut]]:
        """Plain text and tool_use blocks, parsed as the chat path parses calls."""
        if not self.chat.use_tools:
            return text, []
        content, calls = self.chat.family.parse(text)
        return content, limit_calls(self.body, [tool_use_block(c.function.name, c.function.arguments)
                                                for c in calls])

    def respond(self, job: Job, results: list[ChoiceResult]) -> Message:
        r = results[0]
        out = Output(r.text, r.token_ids, r.finish_reason, r.stats)
        text, calls = self.split(r.text)
        stop_reason, stop_sequence = stop_of(self.body, job, out, calls)
        content: list[TextOut | ToolUseOut] = [TextOut(text=text)] if text else []  # none for an empty answer
        return Message(id=f"msg_{job.id}", model=job.model.name, content=content + calls, stop_reason=stop_reason,
                       stop_sequence=stop_sequence, usage=usage_of(job, out))

    def stream(self, job: Job) -> AsyncIterator[bytes]:
        return EventStream(self.service, self.body, self.chat, job).events()


@post("/v1/messages", status_code=200)
async def messages(request: Request, state: State) -> Response | Stream:
    """Anthropic's Messages API, served through the chat path."""
    return await generate(request, state, messages_decoder, MessagesHandler)


@post("/v1/messages/count_tokens", status_code=200)
async def count_tokens(request: Request, state: State) -> Response:
    """The prompt's length in tokens, templated exactly as /v1/messages templates it."""
    service: Service = state.app_state.service
    body = decode(await request.body(), count_decoder)
    chat = ChatHandler(service, chat_request(body), request.headers.get(DECODER_HEADER))
    ids = await asyncio.to_thread(chat.prompt_ids)  # templating takes a thread, as in ``generate``
    return json_response(TokenCount(input_tokens=len(ids)), {})


ROUTES = [messages, count_tokens]
