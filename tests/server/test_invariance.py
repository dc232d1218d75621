"""One answer per request at temperature 0, whatever the path, through the real server and SDK.

The default model in the served format, on prompts no earlier request has sent (each run draws
new ones, so none is in the prefix cache or the suffix drafter's memory before its first send):

- fresh == cached: the same request again, its prompt now in the prefix cache;
- alone == batched: eight requests at once give what each gives alone;
- eagle == ar: every draft source gives plain AR's tokens, the eagle request sent first;
- a long prompt (hundreds of tokens, prefilled in chunks) is no exception;
- beside a busy neighbour == alone: the thread governor runs steps on one thread while another
  program holds a core (decoders/engine/openmp.py), and the log-probabilities are the same bits.

Eager and compiled steps, and one rank against two, are held to the same bits in
tests/decoders/engine/compile/test_compiled.py and tests/decoders/engine/test_parallel.py.
"""

from __future__ import annotations

import random
import secrets
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from server_fixture import sdk_client

MODEL = "SmolLM2-135M-Instruct"
TOKENS = 40
TOPICS = ["a lighthouse", "copper wire", "a bakery run by robots", "the moons of Jupiter", "a chess opening",
          "tide pools", "a violin maker", "solar panels", "a mountain railway", "honey bees", "a night market",
          "glaciers", "a paper airplane", "an old typewriter", "desert cacti", "a submarine cable"]
ASKS = ["Write two sentences about {t}, mentioning the number {n}.", "Give three facts about {t}. Start with {n}.",
        "Describe {t} to a child in one short paragraph; include the year {n}.",
        "Write a Python function named f{n} that returns a string about {t}."]


def new_prompts(count: int) -> list[str]:
    """Prompts this server has not seen: a fresh random draw each run."""
    rng = random.Random(secrets.randbits(64))
    return [rng.choice(ASKS).format(t=rng.choice(TOPICS), n=rng.randrange(10_000, 99_999)) for _ in range(count)]


@pytest.fixture(scope="module")
def client(server_url: str) -> openai.OpenAI:
    return sdk_client(server_url, needs="eagle")


def ask(client: openai.OpenAI, prompt: str, decoder: str = "ar", **extra) -> str:
    """The completion's text at temperature 0 (greedy: equal texts are equal tokens here)."""
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                         max_tokens=TOKENS, temperature=0, extra_body={"decoder": decoder, **extra})
    return out.choices[0].message.content


def test_fresh_equals_cached(client):
    for prompt in new_prompts(4):
        fresh = ask(client, prompt)
        assert ask(client, prompt) == fresh, prompt


def test_long_prompt_fresh_equals_cached(client):
    """A prompt of several hundred tokens: prefilled whole when new, only its tail after a cache hit."""
    rng = random.Random(secrets.randbits(64))
    notes = " ".join(f"Note {i}: {rng.choice(TOPICS)} costs {rng.randrange(100, 999)} coins." for i in range(40))
    prompt = f"{notes}\nWhich note mentions the highest cost? Answer with its number."
    fresh = ask(client, prompt)
    assert ask(client, prompt) == fresh


def test_alone_equals_batched(client):
    prompts = new_prompts(8)
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda p: ask(client, p), prompts))
    alone = [ask(client, p) for p in prompts]
    assert together == alone


@pytest.mark.parametrize("draft", ["auto", "head", "block", "suffix", "both"])
def test_eagle_equals_ar_on_new_prompts(client, draft):
    for prompt in new_prompts(2):
        eagle = ask(client, prompt, "eagle", draft=draft)  # first: nothing of ar's answer is cached
        assert ask(client, prompt, "ar") == eagle, prompt


def test_readme_example_answers_paris(client):
    assert "Paris" in ask(client, "What is the capital of France?")


def team(server_url: str) -> dict | None:
    """The thread governor's state on /status.json (None where the server does not govern)."""
    return httpx.get(f"{server_url.removesuffix('/v1')}/status.json", timeout=10).json()["threads"]


def wait_team(server_url: str, want, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if want(team(server_url)):
            return True
        time.sleep(0.05)
    return False


def logprobs(client: openai.OpenAI, prompt: str) -> list[float]:
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                         max_tokens=TOKENS, temperature=0, logprobs=True,
                                         extra_body={"decoder": "ar"})
    return [t.logprob for t in out.choices[0].logprobs.content]


def test_beside_a_busy_neighbour_equals_alone(client, server_url):
    state = team(server_url)
    if state is None or state["threads"] < 2:
        pytest.skip("the server runs one thread: no team to shrink")
    prompts = new_prompts(3)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        beside = []
        for p in prompts:  # each request starts on the smaller team
            assert wait_team(server_url, lambda t: t["team"] < t["threads"]), "a busy neighbour must shrink the team"
            beside.append(logprobs(client, p))
    finally:
        hog.kill()
        hog.wait()
    if not wait_team(server_url, lambda t: t["team"] == t["threads"]):
        pytest.skip("other work on this host keeps the cores busy: the full team never came back")
    alone = [logprobs(client, p) for p in prompts]
    assert alone == beside
