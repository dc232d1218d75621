"""/v1/chat/completions: messages -> chat template -> prompt ids, and results -> chat bodies.

The model's own chat template (from tokenizer_config.json or the GGUF file) is
rendered by ``dualserve.models.chat_template`` in a sandbox; a template error
is the client's 400, not our 500.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from .errors import bad_request
from .protocol import ChatCompletion, ChatCompletionRequest
from .responses import chat_body, chat_stream
from .service import Job, Service


def message_dicts(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    if not body.messages:
        raise bad_request("messages must be a non-empty list", "messages", "missing_required_parameter")
    out = []
    for i, m in enumerate(body.messages):
        content = m.content
        if isinstance(content, list):  # content parts: keep the text ones
            texts = []
            for part in content:
                if part.get("type") not in ("text", "input_text"):
                    raise bad_request(f"messages[{i}].content: only text parts are supported, got "
                                      f"{part.get('type')!r}", f"messages[{i}].content", "unsupported_content")
                texts.append(str(part.get("text", "")))
            content = "".join(texts)
        d: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.name:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = m.tool_calls
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


class ChatHandler:
    def __init__(self, service: Service, body: ChatCompletionRequest, header_decoder: str | None):
        self.service = service
        self.body = body
        self.header_decoder = header_decoder
        self.model = service.model(body.model)

    def prompt_ids(self) -> list[int]:
        from dualserve.models.chat_template import ChatTemplateError

        tok = self.model.tokenizer
        try:
            extra = {k: v for k, v in (self.body.chat_template_kwargs or {}).items()
                     if k not in ("messages", "tools", "add_generation_prompt")}
            text = tok.apply_chat_template(message_dicts(self.body), tools=self.body.tools,
                                           add_generation_prompt=True, **extra)
        except ChatTemplateError as e:
            raise bad_request(f"could not apply the chat template: {e}", "messages", "invalid_messages") from None
        return tok.encode(text, add_special_tokens=False)

    def start(self) -> Job:
        body = self.body
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
        ids = self.prompt_ids()
        route = self.service.route(self.model, body, self.header_decoder,
                                   structured=bool(body.response_format and body.response_format.type != "text"))
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = self.service.sampling_params(body, max_tokens, logprobs, len(ids), self.model, default_max=None)
        return self.service.start(self.model, route, [ids], params, body.n)

    async def complete(self, job: Job) -> ChatCompletion:
        results = await self.service.collect(job)
        return chat_body(self.service, job, results, self.body.logprobs, results[0].stats if results else None)

    def stream(self, job: Job) -> AsyncIterator[bytes]:
        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
        return chat_stream(self.service, job, self.body.logprobs, include_usage)
