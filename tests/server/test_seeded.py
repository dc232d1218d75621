"""Seeded sampling through the real server and SDK: a seed gives one text, whatever runs beside it.

At temperature 1 with a ``seed``, on every decoder:

- alone == among three other (unseeded, different) requests running concurrently;
- ``eagle`` == ``ar`` token for token, with every draft source, drafts accepted or not (the token
  at output position t is drawn with a uniform keyed by (seed, t), and a draft is accepted iff it
  equals that sample: ``decoders/eagle/tree.py``);
- choice i of ``n`` is the single request with seed + i.
"""

from __future__ import annotations

import random
import secrets
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from server_fixture import sdk_client

MODEL = "SmolLM2-135M-Instruct"
TOKENS = 24
SEED = 1234
PROMPT = "Write a short poem about the sea."
OTHERS = ["Tell me about cats and dogs.", "What is the capital of Spain? Explain its history.",
          "List ten fruits and describe each."]
# Repeats text, so suffix lookup drafts what the answer copies and the drafts are accepted.
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
REPEAT = f"Repeat this code exactly:\n{CODE}"


@pytest.fixture(scope="module")
def client(server_url: str) -> openai.OpenAI:
    return sdk_client(server_url, needs="eagle")


def ask(client: openai.OpenAI, prompt: str, decoder: str, seed: int | None = SEED, max_tokens: int = TOKENS,
        **extra):
    """The completion at temperature 1, and the decoder that served it."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=1.0,
        seed=seed, extra_body={"decoder": decoder, **extra})
    assert raw.headers["x-dualserve-decoder"] == decoder
    return raw.parse()


def new_prompts(count: int) -> list[str]:
    """Prompts this server has not seen (none in the prefix cache or suffix lookup's memory)."""
    rng = random.Random(secrets.randbits(64))
    things = ["a lighthouse", "copper wire", "tide pools", "a violin maker", "honey bees", "glaciers"]
    return [f"Write two sentences about {rng.choice(things)}, mentioning the number {rng.randrange(10**4, 10**5)}."
            for _ in range(count)]


@pytest.mark.parametrize("decoder", ["ar", "eagle", "diffusion"])
def test_a_seed_gives_the_same_text_alone_and_among_concurrent_requests(client, decoder):
    alone = ask(client, PROMPT, decoder).choices[0].message.content
    with ThreadPoolExecutor(len(OTHERS)) as pool:
        others = [pool.submit(ask, client, p, decoder, None, 2 * TOKENS) for p in OTHERS]
        beside = ask(client, PROMPT, decoder).choices[0].message.content
        for f in others:
            f.result()
    assert beside == alone


def test_seeded_eagle_is_seeded_ar_token_for_token(client):
    prompts = new_prompts(3)
    for i, prompt in enumerate(prompts):
        eagle = ask(client, prompt, "eagle", seed=SEED + i)  # eagle first: nothing of it is cached yet
        ar = ask(client, prompt, "ar", seed=SEED + i)
        assert eagle.choices[0].message.content == ar.choices[0].message.content, prompt
        assert eagle.usage.completion_tokens == ar.usage.completion_tokens


@pytest.mark.parametrize("draft", ["suffix", "head", "block", "auto"])
def test_seeded_eagle_with_drafts_accepted_is_seeded_ar(client, draft):
    ar = ask(client, REPEAT, "ar", max_tokens=40)
    eagle = ask(client, REPEAT, "eagle", max_tokens=40, draft=draft)
    assert eagle.choices[0].message.content == ar.choices[0].message.content
    if draft == "suffix":  # the answer copies the prompt: suffix drafts are verified and accepted
        assert eagle.usage.model_extra["dualserve"]["mean_accept_length"] > 1


def test_choice_i_of_n_is_the_request_with_seed_plus_i(client):
    both = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                          max_tokens=TOKENS, temperature=1.0, seed=SEED, n=2,
                                          extra_body={"decoder": "ar"})
    texts = [c.message.content for c in sorted(both.choices, key=lambda c: c.index)]
    assert texts[0] == ask(client, PROMPT, "ar").choices[0].message.content
    assert texts[1] == ask(client, PROMPT, "ar", seed=SEED + 1).choices[0].message.content
    assert texts[0] != texts[1]
