"""The diffusion decoder through the real server and the real openai SDK (the default model's twin)."""

from __future__ import annotations

import openai
import pytest
from server_fixture import sdk_client

MODEL = "SmolLM2-135M-Instruct"
DIFFUSION = {"decoder": "diffusion"}


@pytest.fixture(scope="module")
def client(server_url: str) -> openai.OpenAI:
    return sdk_client(server_url, needs="diffusion")


def test_completion_reports_decoder_and_forwards(client):
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="The capital of France is",
                                                      max_tokens=16, temperature=0, extra_body=DIFFUSION)
    assert raw.headers["x-dualserve-decoder"] == "diffusion"
    body = raw.parse()
    choice = body.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.text
    stats = body.usage.model_extra["dualserve"]
    assert stats["decoder"] == "diffusion" and stats["forward_passes"] >= 1
    assert 0 < body.usage.completion_tokens <= 16


def test_streamed_chat_equals_non_streamed(client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                           extra_body=DIFFUSION)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=DIFFUSION))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals and finals[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_stop_string_trims_exactly(client):
    full = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=16, temperature=0,
                                     extra_body=DIFFUSION).choices[0].text
    if len(full) < 4:
        pytest.skip("the twin produced too little text to cut")
    stop = full[2:4]
    cut = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=16, temperature=0,
                                    stop=[stop], extra_body=DIFFUSION).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full[: full.index(stop)]


def test_n_seed_and_logprobs(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0.8, seed=7, n=2, logprobs=1,
              extra_body=DIFFUSION)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len(a.choices) == 2
    for c in a.choices:
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs)
        assert all(v <= 0 for v in c.logprobs.token_logprobs)


def test_auto_routes_interactive_work_to_diffusion(client):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        extra_body={"priority": "interactive", "latency_budget_ms": 300})
    assert raw.headers["x-dualserve-decoder"] == "diffusion"
    assert "latency" in raw.headers["x-dualserve-route-reason"]


def test_twin_refuses_a_suffix_that_auto_fills_in_the_middle(client):
    """The twin's block-causal attention never sees a suffix: asked for one, it answers a 400 that
    says so; ``auto`` sends the request to an AR decoder, which fills in the middle instead."""
    kw = dict(model=MODEL, prompt="def add(a, b):\n    return", suffix="\n\nprint(add(1, 2))\n", max_tokens=4,
              temperature=0)
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(**kw, extra_body=DIFFUSION)
    assert exc.value.body["param"] == "suffix" and "infill" in exc.value.body["message"]
    raw = client.completions.with_raw_response.create(**kw)
    assert raw.headers["x-dualserve-decoder"] in ("ar", "eagle")
    assert raw.parse().choices[0].finish_reason in ("stop", "length")
