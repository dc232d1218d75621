"""The EAGLE decoder through the real server and the real openai SDK: lossless greedy, exact stops, metrics."""

from __future__ import annotations

import openai
import pytest
from server_fixture import sdk_client

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def client(server_url: str) -> openai.OpenAI:
    return sdk_client(server_url, needs="eagle")


@pytest.mark.parametrize("prompt", ["What is the capital of France?", "Write a Python function that adds two numbers."])
def test_greedy_chat_identical_to_plain_ar(client, prompt):
    messages = [{"role": "user", "content": prompt}]
    outs = {}
    for decoder in ("ar", "eagle"):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=32, temperature=0, logprobs=True,
            extra_body={"decoder": decoder})
        assert raw.headers["x-dualserve-decoder"] == decoder
        outs[decoder] = raw.parse()
    ar, eagle = outs["ar"], outs["eagle"]
    assert eagle.choices[0].message.content == ar.choices[0].message.content
    assert eagle.usage.completion_tokens == ar.usage.completion_tokens
    assert len(eagle.choices[0].logprobs.content) == eagle.usage.completion_tokens
    stats = eagle.usage.model_extra["dualserve"]
    assert stats["mean_accept_length"] >= 1 and "draft_seconds" in stats and "verify_seconds" in stats


def test_streamed_stop_is_exact(client):
    kw = dict(model=MODEL, prompt="List: apples, pears, plums, cherries,", max_tokens=24, temperature=0)
    full = client.completions.create(**kw, extra_body={"decoder": "ar"}).choices[0].text
    if len(full) < 6:
        pytest.skip("too little text to cut")
    stop = full[3:6]
    chunks = list(client.completions.create(**kw, stop=[stop], stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"decoder": "eagle"}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full[: full.index(stop)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


@pytest.mark.parametrize("draft", ["head", "block", "suffix", "both"])
def test_draft_sources_greedy_identical(client, draft):
    """Each choice of draft sources (the ``draft`` body field) gives plain AR's greedy text."""
    text = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
    messages = [{"role": "user", "content": f"Repeat this code exactly:\n{text}"}]
    kw = dict(model=MODEL, messages=messages, max_tokens=40, temperature=0)
    ar = client.chat.completions.create(**kw, extra_body={"decoder": "ar"})
    eagle = client.chat.completions.create(**kw, extra_body={"decoder": "eagle", "draft": draft})
    assert eagle.choices[0].message.content == ar.choices[0].message.content
    stats = eagle.usage.model_extra["dualserve"]
    if draft in ("head", "block"):  # the named model alone (the budget may find it does not pay here)
        other = "block" if draft == "head" else "head"
        assert not stats.get("suffix_steps") and not stats.get(f"{other}_steps"), str(stats)


def test_unknown_draft_source_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={"decoder": "eagle", "draft": "oracle"})
    assert err.value.body["param"] == "draft"
