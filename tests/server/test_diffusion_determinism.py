"""Temperature 0 on DiffusionGemma is deterministic through a real server (issue 14).

A tiny random DiffusionGemma checkpoint (``tests/tiny_checkpoints.py``, word-level tokenizer)
is served in this process behind uvicorn and driven with the real openai SDK:

* ``temperature: 0`` without a seed returns the same text on every call, alone and under
  concurrent load (requests batched into the same denoiser forwards beside other prompts);
* at temperature 1, the same seed returns the same text and other seeds other texts.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import openai
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

from dualserve.decoders.deployment import PoolSpec, build_deployment
from dualserve.decoders.engine.engine import EngineConfig
from dualserve.models.diffusion_gemma import load_diffusion_gemma
from dualserve.models.tokenizer import Tokenizer
from dualserve.server.app import AppState, create_app
from dualserve.server.router import Router
from dualserve.server.service import ServedModel, Service
from tiny_checkpoints import write_tiny_diffusion_gemma
from server_fixture import serve_in_thread

MODEL = "tiny-diffusion-gemma"
VOCAB = 512
PROMPT = "w10 w20 w30 w40"
OTHERS = ["w7 w8 w9", "w100 w200 w300 w400 w500 w11 w12 w13 w14 w15", "w42"]

pytestmark = pytest.mark.usefixtures("one_thread")


def word_tokenizer() -> Tokenizer:
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    backend = Backend(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(["<pad>", "<eos>", "<bos>"])
    return Tokenizer(backend, bos_token_id=2, eos_token_id=1, pad_token_id=0)


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> Iterator[openai.OpenAI]:
    path = write_tiny_diffusion_gemma(tmp_path_factory.mktemp("diffusion_gemma"))
    loaded = load_diffusion_gemma(path, name=MODEL, tokenizer=word_tokenizer())
    dep = build_deployment([loaded], EngineConfig(max_batched_tokens=64), PoolSpec(block_size=4, num_blocks=256))
    served = {MODEL: ServedModel(MODEL, loaded.tokenizer, 512, dep.engine.decoders_for(MODEL))}
    service = Service(dep.engine, served, Router())
    dep.engine.start()
    with serve_in_thread(create_app(AppState(service=service))) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    dep.engine.shutdown()


def complete(client: openai.OpenAI, prompt: str, **kw) -> str:
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, **kw)
    assert r.choices[0].finish_reason in ("stop", "length")
    return r.choices[0].text


def test_temperature_zero_without_a_seed_is_the_same_every_time(client) -> None:
    first = complete(client, PROMPT, temperature=0)
    assert first and all(complete(client, PROMPT, temperature=0) == first for _ in range(2))


def test_temperature_zero_is_the_same_under_concurrent_load(client) -> None:
    alone = complete(client, PROMPT, temperature=0)
    jobs = [(PROMPT, {"temperature": 0})] * 8 + [(p, {"temperature": 0}) for p in OTHERS] + \
        [(p, {"temperature": 1, "seed": i}) for i, p in enumerate(OTHERS)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        texts = list(pool.map(lambda job: complete(client, job[0], **job[1]), jobs))
    assert texts[:8] == [alone] * 8
    n = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, n=3)
    assert [c.text for c in n.choices] == [alone] * 3


def test_a_seed_still_varies_the_output_above_temperature_zero(client) -> None:
    texts = [complete(client, PROMPT, temperature=1, seed=seed) for seed in (1, 1, 2, 3)]
    assert texts[0] == texts[1] and len(set(texts)) == 3
