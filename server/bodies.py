"""Engine results -> response bodies and stream chunks of /v1/completions and /v1/chat/completions.

One place knows OpenAI's logprob formats, usage accounting and the rule that
``finish_reason`` rides on the last content chunk, before an optional usage
chunk with empty ``choices`` and ``data: [DONE]``.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from dualserve.decoders.engine.sampling import TokenLogprob

from .protocol import (ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatDelta, ChatLogprobs,
                       ChatResponseMessage, ChatTokenLogprob, Completion, CompletionChoice, CompletionLogprobs,
                       TopLogprob, Usage, encoder)
from .service import ChoiceResult, Job, Service


def usage_for(job: Job, completion_tokens: int, stats: dict[str, Any] | None = None) -> Usage:
    prompt_tokens = sum(len(p) for p in job.prompts)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens, dualserve=stats or None)


def completion_logprobs(service: Service, job: Job, lps: list[TokenLogprob], offset: int) -> CompletionLogprobs:
    tokens, values, tops, offsets = [], [], [], []
    for lp in lps:
        text = service.token_text(job.model, lp.token_id)
        tokens.append(text)
        values.append(lp.logprob)
        tops.append({service.token_text(job.model, t): v for t, v in lp.top} if job.params.logprobs else None)
        offsets.append(offset)
        offset += len(text)
    return CompletionLogprobs(tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets)


def chat_logprobs(service: Service, job: Job, lps: list[TokenLogprob]) -> ChatLogprobs:
    def top(token_id: int, value: float) -> TopLogprob:
        text = service.token_text(job.model, token_id)
        return TopLogprob(token=text, logprob=value, bytes=list(text.encode("utf-8")))

    content = []
    for lp in lps:
        chosen = top(lp.token_id, lp.logprob)
        content.append(ChatTokenLogprob(token=chosen.token, logprob=lp.logprob, bytes=chosen.bytes,
                                        top_logprobs=[top(t, v) for t, v in lp.top]))
    return ChatLogprobs(content=content)


def prompt_logprobs(service: Service, job: Job, prompt: list[int],
                    values: list[TokenLogprob | None] | None) -> CompletionLogprobs:
    """Echoed prompt tokens in OpenAI's completion logprob format (the first token has none)."""
    values = values or [None] * len(prompt)
    tokens, logps, tops, offsets = [], [], [], []
    offset = 0
    for tid, lp in zip(prompt, values):
        text = service.token_text(job.model, tid)
        tokens.append(text)
        logps.append(lp.logprob if lp is not None else None)
        tops.append({service.token_text(job.model, t): v for t, v in lp.top} if lp is not None and lp.top else None)
        offsets.append(offset)
        offset += len(text)
    return CompletionLogprobs(tokens=tokens, token_logprobs=logps, top_logprobs=tops, text_offset=offsets)


def join_logprobs(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(tokens=a.tokens + b.tokens, token_logprobs=a.token_logprobs + b.token_logprobs,
                              top_logprobs=a.top_logprobs + b.top_logprobs, text_offset=a.text_offset + b.text_offset)


def completion_body(service: Service, job: Job, results: list[ChoiceResult], echo_texts: list[str],
                    stats: dict[str, Any] | None) -> Completion:
    choices = []
    for i, r in enumerate(results):
        prefix = echo_texts[i // job.n] if echo_texts else ""
        lps = completion_logprobs(service, job, r.logprobs, len(prefix)) \
            if job.params.logprobs is not None else None
        if lps is not None and echo_texts:
            lps = join_logprobs(prompt_logprobs(service, job, job.prompt_of(i), r.prompt_logprobs), lps)
        choices.append(CompletionChoice(index=i, text=prefix + r.text, logprobs=lps,
                                        finish_reason=r.finish_reason))
    used = sum(len(r.token_ids) for r in results)
    return Completion(id=f"cmpl-{job.id}", created=job.created, model=job.model.name, choices=choices,
                      usage=usage_for(job, used, stats))


def chat_body(service: Service, job: Job, results: list[ChoiceResult], want_logprobs: bool,
              stats: dict[str, Any] | None, tool_parser=None) -> ChatCompletion:
    choices = []
    for i, r in enumerate(results):
        message = ChatResponseMessage(content=r.text)
        finish = r.finish_reason
        if tool_parser is not None:
            content, calls = tool_parser(r.text)
            if calls:
                message = ChatResponseMessage(content=content or None, tool_calls=calls)
                finish = "tool_calls"
        lps = chat_logprobs(service, job, r.logprobs) if want_logprobs else None
        choices.append(ChatChoice(index=i, message=message, logprobs=lps, finish_reason=finish))
    used = sum(len(r.token_ids) for r in results)
    return ChatCompletion(id=f"chatcmpl-{job.id}", created=job.created, model=job.model.name, choices=choices,
                          usage=usage_for(job, used, stats))


def sse(obj: Any) -> bytes:
    return b"data: " + encoder.encode(obj) + b"\n\n"


async def completion_stream(service: Service, job: Job, echo_texts: list[str],
                            include_usage: bool) -> AsyncIterator[bytes]:
    used = 0
    stats = None
    offsets = [len(echo_texts[i // job.n]) if echo_texts else 0 for i in range(job.num_choices)]
    echoed: set[int] = set()
    async for index, delta in service.deltas(job):
        if echo_texts and index not in echoed:
            # The echo chunk waits for the first delta, which carries the prompt logprobs.
            echoed.add(index)
            lps = prompt_logprobs(service, job, job.prompt_of(index), delta.prompt_logprobs) \
                if job.params.logprobs is not None else None
            chunk = CompletionChoice(index=index, text=echo_texts[index // job.n], logprobs=lps)
            yield sse(Completion(id=f"cmpl-{job.id}", created=job.created, model=job.model.name, choices=[chunk]))
        used += len(delta.token_ids)
        stats = stats or delta.stats
        if not delta.text and not delta.finish_reason and not delta.token_ids:
            continue
        lps = None
        if job.params.logprobs is not None and delta.logprobs:
            lps = completion_logprobs(service, job, delta.logprobs, offsets[index])
        offsets[index] += len(delta.text)
        choice = CompletionChoice(index=index, text=delta.text, logprobs=lps, finish_reason=delta.finish_reason)
        yield sse(Completion(id=f"cmpl-{job.id}", created=job.created, model=job.model.name, choices=[choice]))
    if include_usage:
        yield sse(Completion(id=f"cmpl-{job.id}", created=job.created, model=job.model.name, choices=[],
                             usage=usage_for(job, used, stats)))
    yield b"data: [DONE]\n\n"


async def chat_stream(service: Service, job: Job, want_logprobs: bool, include_usage: bool,
                      tool_stream=None) -> AsyncIterator[bytes]:
    cid = f"chatcmpl-{job.id}"

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> bytes:
        return sse(ChatCompletionChunk(id=cid, created=job.created, model=job.model.name, choices=choices,
                                       usage=usage))

    for i in range(job.num_choices):
        yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
    used = 0
    stats = None
    tools = [tool_stream() for _ in range(job.num_choices)] if tool_stream else None
    async for index, delta in service.deltas(job):
        used += len(delta.token_ids)
        stats = stats or delta.stats
        lps = chat_logprobs(service, job, delta.logprobs) if want_logprobs and delta.logprobs else None
        finish = delta.finish_reason
        if tools is not None:
            out_delta, saw_calls = tools[index].feed(delta.text, final=finish is not None)
            if finish and saw_calls:
                finish = "tool_calls"
        else:
            out_delta = ChatDelta(content=delta.text) if delta.text else ChatDelta()
        if out_delta == ChatDelta() and not finish and lps is None:
            continue
        yield chunk([ChatChunkChoice(index=index, delta=out_delta, logprobs=lps, finish_reason=finish)])
    if include_usage:
        yield chunk([], usage_for(job, used, stats))
    yield b"data: [DONE]\n\n"
