"""A seeded fuzz campaign over every endpoint that takes a body, against the real server.

Bodies come from ``clients/fuzz.py`` (hypothesis strategies: valid values beside the ones that
once broke a decoder, wrong types, out-of-vocabulary ids, huge values, bodies that are not JSON
objects). Every answer must be a 200 with the endpoint's answer, or a 4xx in the endpoint's error
shape (Anthropic's under /v1/messages, OpenAI's elsewhere), or a deliberate 503 / 504; every
stream must end with its end marker and carry no server error, an ``n_predict: 0`` /completion
must generate nothing, and no request may hang. Each endpoint gets its own campaign, seeded, so a
failure replays; generation stays at a few tokens, so all the campaigns' requests take about a
minute on an idle machine. The verdict itself is checked too, on answers known to be right or wrong.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings

from dualserve.clients.fuzz import is_stream, request, verdict

HANG_S = 60.0  # a request that takes longer has hung
# Generation and rerank cost a forward or more per request; the tokenizer and template endpoints
# answer in milliseconds, so they take more examples for the time.
EXAMPLES = {
    "/v1/completions": 100, "/v1/chat/completions": 80, "/infill": 50, "/completion": 200,
    "/v1/fim/completions": 150, "/v1/messages": 200, "/v1/messages/count_tokens": 100, "/v1/embeddings": 150,
    "/v1/rerank": 60, "/tokenize": 200, "/detokenize": 150, "/apply-template": 150,
    "/v1/chat/completions/input_tokens": 150,
}
STATUSES: dict[str, Counter] = defaultdict(Counter)  # by endpoint, filled as the campaigns run


@pytest.fixture(scope="module")
def http(server_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server_url, timeout=HANG_S) as c:
        yield c


def check(http: httpx.Client, endpoint: str, raw: bytes) -> None:
    try:
        r = http.post(endpoint, content=raw, headers={"Content-Type": "application/json"})
    except httpx.TimeoutException:
        pytest.fail(f"hung for {HANG_S:.0f} s: {endpoint} {raw[:300]!r}")
    STATUSES[endpoint][r.status_code] += 1
    problem = verdict(r.status_code, r.content, is_stream(raw), endpoint, raw)
    assert problem is None, f"{endpoint} {raw[:500]!r} -> {problem}"


def campaign(endpoint: str):
    @seed(15)
    @settings(max_examples=EXAMPLES[endpoint], deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=[HealthCheck.too_slow])
    @given(item=request(endpoint))
    def run(http: httpx.Client, item: tuple[str, bytes]) -> None:
        check(http, *item)

    return run


test_completions_fuzz = campaign("/v1/completions")
test_chat_fuzz = campaign("/v1/chat/completions")
test_infill_fuzz = campaign("/infill")
test_llamacpp_completion_fuzz = campaign("/completion")
test_fim_completions_fuzz = campaign("/v1/fim/completions")
test_messages_fuzz = campaign("/v1/messages")
test_count_tokens_fuzz = campaign("/v1/messages/count_tokens")
test_embeddings_fuzz = campaign("/v1/embeddings")
test_rerank_fuzz = campaign("/v1/rerank")
test_tokenize_fuzz = campaign("/tokenize")
test_detokenize_fuzz = campaign("/detokenize")
test_apply_template_fuzz = campaign("/apply-template")
test_input_tokens_fuzz = campaign("/v1/chat/completions/input_tokens")


def test_the_campaign_was_served_not_only_refused() -> None:
    """A campaign of nothing but 400s would prove little: about half the bodies are valid, and at
    least a quarter of each endpoint's requests must be served."""
    for endpoint, statuses in STATUSES.items():
        assert statuses[200] >= sum(statuses.values()) // 4, (endpoint, dict(statuses))


# Answers for checking the verdict: an error in each shape, the ends of llama.cpp's and Anthropic's streams.
OPENAI_ERROR = b'{"error":{"message":"no","type":"invalid_request_error","param":null,"code":null}}'
ANTHROPIC_ERROR = b'{"type":"error","error":{"type":"invalid_request_error","message":"no"}}'
LLAMA_END = b'data: {"content":"","stop":true}\n\n'
MESSAGE_START = b'event: message_start\ndata: {"type":"message_start","message":{}}\n\n'
MESSAGE_STOP = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'


@pytest.mark.parametrize("status, content, streamed, endpoint", [
    (200, b'{"choices":[]}', False, "/v1/completions"), (400, OPENAI_ERROR, False, "/tokenize"),
    (503, OPENAI_ERROR, False, "/v1/rerank"), (404, ANTHROPIC_ERROR, False, "/v1/messages/count_tokens"),
    (200, b'data: {"content":"a","stop":false}\n\n' + LLAMA_END, True, "/completion"),
    (200, b'[{"content":""},{"content":""}]', False, "/completion"),
    (200, b'data: {"choices":[]}\n\ndata: [DONE]\n\n', True, "/v1/fim/completions"),
    (200, MESSAGE_START + MESSAGE_STOP, True, "/v1/messages"),
    (200, MESSAGE_START + b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"x"}}\n\n',
     True, "/v1/messages"),
])
def test_the_verdict_accepts(status: int, content: bytes, streamed: bool, endpoint: str) -> None:
    assert verdict(status, content, streamed, endpoint) is None


@pytest.mark.parametrize("status, content, streamed, endpoint", [
    (500, OPENAI_ERROR, False, "/tokenize"), (400, ANTHROPIC_ERROR, False, "/v1/embeddings"),
    (400, OPENAI_ERROR, False, "/v1/messages"), (200, b'{"prompt":""}', False, "/detokenize"),
    (200, b"data: [DONE]\n\n", True, "/completion"), (200, LLAMA_END, True, "/v1/fim/completions"),
    (200, b'data: {"error":{"type":"server_error"}}\n\n' + LLAMA_END, True, "/completion"),
    (200, MESSAGE_START, True, "/v1/messages"), (200, b"data: [DONE]\n\n", True, "/v1/messages"),
    (200, MESSAGE_START + b'event: error\ndata: {"type":"error","error":{"type":"api_error","message":"x"}}\n\n',
     True, "/v1/messages"),
])
def test_the_verdict_rejects(status: int, content: bytes, streamed: bool, endpoint: str) -> None:
    """The campaign's oracle is only as good as its refusals: each of these answers is wrong."""
    assert verdict(status, content, streamed, endpoint) is not None


def test_the_verdict_holds_n_predict_0_to_no_output() -> None:
    streamed = b'data: {"content":"a","tokens_predicted":1,"stop":true}\n\n'
    assert verdict(200, streamed, True, "/completion", b'{"prompt": "a", "n_predict": 1, "stream": true}') is None
    assert verdict(200, streamed, True, "/completion", b'{"prompt": "a", "n_predict": 0, "stream": true}')
    several = b'[{"content":"","tokens_predicted":0},{"content":"a","tokens_predicted":1}]'
    assert verdict(200, several, False, "/completion", b'{"prompt": ["a", "b"], "n_predict": 0}')
