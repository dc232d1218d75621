"""The in-process engine harness of the engine tests: a tiny random Llama-style model on the default
model's tokenizer, engines that must end idle with every block back in the pool, and a client that
gathers each choice's deltas as the server's sinks do."""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Iterator

import pytest
import torch

from dualserve.decoders.ar import ARDecoder
from dualserve.decoders.engine.engine import Engine, EngineConfig
from dualserve.decoders.engine.request import Delta
from dualserve.decoders.engine.runner import ModelRunner
from dualserve.decoders.engine.sampling import SamplingParams
from dualserve.models.config import ModelConfig
from dualserve.models.loader import LoadedModel, converted_dir, load_model
from dualserve.models.tokenizer import Tokenizer
from dualserve.models.transformer import Transformer

MODEL = "m"
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
TINY = ModelConfig(family="llama", vocab_size=49152, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16, intermediate_size=128, max_position_embeddings=4096)


# ---- fixtures -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(default_gguf, cache_dir) -> Tokenizer:
    target = converted_dir(default_gguf, cache_dir)
    if not target.exists():
        load_model(default_gguf, cache_dir=cache_dir)  # converts the GGUF once
    return Tokenizer.from_hf_dir(target)


@pytest.fixture(scope="module")
def tiny() -> Transformer:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return Transformer(TINY).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def real(default_gguf, cache_dir) -> LoadedModel:
    return load_model(default_gguf, cache_dir=cache_dir)


@pytest.fixture(autouse=True)
def built() -> Iterator[list[Engine]]:
    """Every engine a test builds; afterwards each must be idle with every block back in its pool."""
    engines: list[Engine] = []
    yield engines
    for engine in engines:
        engine.shutdown()
        assert not engine.has_work(), "requests are left in the engine"
        assert engine.pool.num_used_blocks == 0, f"{engine.pool.num_used_blocks} blocks leaked"
        engine.pool.check(tables=[])


@pytest.fixture
def make_engine(built, tiny, tokenizer):
    def make(model: Transformer | None = None, num_blocks: int = 512, block_size: int = 4, **config) -> Engine:
        engine = Engine(EngineConfig(num_blocks=num_blocks, block_size=block_size, **config))
        runner = ModelRunner(model or tiny, num_blocks, block_size, use_flash=False)
        engine.add_decoder(MODEL, ARDecoder(runner, engine.pool), tokenizer)
        built.append(engine)
        return engine
    return make


class Client:
    """Submits to an engine and gathers every choice's deltas, as the server's sinks do."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.deltas: dict[tuple[str, int], list[Delta]] = defaultdict(list)
        self._count = 0

    def submit(self, prompt: list[int], params: SamplingParams = GREEDY, n: int = 1) -> str:
        rid = f"req{self._count}"
        self._count += 1
        self.engine.submit(MODEL, "ar", prompt, params, lambda i, d: self.deltas[(rid, i)].append(d), n=n,
                           request_id=rid)
        return rid

    def tokens(self, rid: str, index: int = 0) -> list[int]:
        return [t for d in self.deltas[(rid, index)] for t in d.token_ids]

    def text(self, rid: str, index: int = 0) -> str:
        return "".join(d.text for d in self.deltas[(rid, index)])

    def final(self, rid: str, index: int = 0) -> Delta:
        last = self.deltas[(rid, index)][-1]
        assert last.finish_reason is not None
        return last


def random_prompts(count: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, TINY.vocab_size) for _ in range(rng.randrange(lo, hi))] for _ in range(count)]


def alone(engine: Engine, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    """Each prompt run by itself, one after another."""
    client = Client(engine)
    out = []
    for p in prompts:
        rid = client.submit(p, params)
        engine.run_until_idle()
        out.append(client.tokens(rid))
    return out


def count_forwarded(engine: Engine) -> list[int]:
    """Record how many tokens each forward of the engine's runner computes."""
    runner = engine.decoders[(MODEL, "ar")].runner
    counts: list[int] = []
    forward = runner.forward

    def counting(items, *args, **kwargs):
        counts.append(sum(len(it.token_ids) for it in items))
        return forward(items, *args, **kwargs)

    runner.forward = counting
    return counts
