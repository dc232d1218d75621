"""A Gemma 3 K-quant GGUF served end to end, through a real server and the openai SDK.

``clients/write_gguf`` writes a small random Gemma 3 (six layers: five local with a window of 8
tokens, one global; Q4_K and Q5_0 matrices, a Q8_0 embedding tied to the head) with the default
model's tokenizer. It is loaded as users load it (``load_model`` on the file, the default weight
format: every block type packed exactly) and served: chat and completions answer, and at
temperature 0 a prompt longer than the window gives the same text fresh, from the prefix cache and
batched beside others (the windowed masks of ``paged_attention`` on every path).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import openai
import pytest

from dualserve.clients import write_gguf as wg
from dualserve.decoders.deployment import PoolSpec, build_deployment
from dualserve.decoders.engine.engine import EngineConfig
from dualserve.models import kernels
from dualserve.models.loader import load_model
from dualserve.server.app import AppState, create_app
from dualserve.server.router import Router
from dualserve.server.service import ServedModel, Service
from server_fixture import serve_in_thread

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPE = wg.Shape("gemma3", hidden=256, layers=6, heads=2, kv_heads=1, head_dim=128, ffn=512, rope_theta=1e6,
                 rms_eps=1e-6, context_length=2048, tied=True, sliding_window=8)
LONG = "The tide pools along the northern shore hold anemones, crabs and small fish that wait for the sea."


@pytest.fixture(scope="module")
def served(default_gguf: Path, tmp_path_factory) -> Iterator[tuple[openai.OpenAI, str]]:
    root = tmp_path_factory.mktemp("gemma3")
    written = wg.write_gguf(root / "tiny-gemma3.gguf", SHAPE, wg.tokenizer_fields(default_gguf), matrix_type="Q4_K",
                            name="tiny gemma3")
    fmt = "w4a16" if kernels.available() else "int4"
    loaded = load_model(written.path, cache_dir=root / "cache", quantization=fmt)
    assert loaded.config.family == "gemma3" and loaded.config.windows == (8, 8, 8, 8, 8, None)
    dep = build_deployment([loaded], EngineConfig(max_batched_tokens=256), PoolSpec(block_size=16, num_blocks=128))
    name = loaded.name
    served = {name: ServedModel(name, loaded.tokenizer, 2048, dep.engine.decoders_for(name))}
    dep.engine.start()
    try:
        with serve_in_thread(create_app(AppState(service=Service(dep.engine, served, Router())))) as url:
            yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120), name
    finally:
        dep.engine.shutdown()


def complete(client: openai.OpenAI, model: str, prompt: str) -> str:
    return client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0).choices[0].text


def test_chat_answers_through_the_sdk(served) -> None:
    client, model = served
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                           max_tokens=8, temperature=0)
    assert reply.choices[0].message.content and reply.usage.completion_tokens == 8


def test_a_prompt_beyond_the_window_is_the_same_fresh_cached_and_batched(served) -> None:
    client, model = served
    fresh = complete(client, model, LONG)
    assert fresh and complete(client, model, LONG) == fresh  # the second time from the prefix cache
    others = ["Copper wiring", "A night market opens at dusk and", LONG + " Then"]
    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(lambda p: complete(client, model, p), [LONG, *others]))
    assert texts[0] == fresh
