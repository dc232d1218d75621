"""Fairness of chunked prefill: a short request sent beside a long prompt starts within a step.

A long prompt is prefilled in chunks of the step's token budget; while other requests wait, the
chunks leave a quarter of the budget (``Scheduler.admission_reserve``) so the waiting ones are
admitted and decode beside it. Chunking never changes greedy output, so both requests must
produce exactly what they produce alone.
"""

from __future__ import annotations

import pytest
import torch

from dualserve.decoders.ar import ARDecoder
from dualserve.decoders.engine.engine import Engine, EngineConfig
from dualserve.decoders.engine.request import Delta
from dualserve.decoders.engine.runner import ModelRunner
from dualserve.decoders.engine.sampling import SamplingParams
from dualserve.models.config import ModelConfig
from dualserve.models.transformer import Transformer

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64
BUDGET = 64
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
LONG = [3 + (i * 7) % 60 for i in range(640)]  # ten full steps of prefill
SHORT = [5, 6, 7, 8]


class Tok:
    eos_token_ids = [0]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(family="llama", vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, intermediate_size=48, max_position_embeddings=2048)
    return Transformer(cfg).eval().requires_grad_(False)


def make_engine(model: Transformer) -> Engine:
    engine = Engine(EngineConfig(num_blocks=256, block_size=4, max_batched_tokens=BUDGET))
    engine.add_decoder("m", ARDecoder(ModelRunner(model, 256, 4, use_flash=False), engine.pool), Tok(), VOCAB)
    return engine


def submit(engine: Engine, prompt: list[int]) -> list[Delta]:
    out: list[Delta] = []
    engine.submit("m", "ar", prompt, GREEDY, lambda _, d: out.append(d))
    return out


def tokens(deltas: list[Delta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def alone(model: Transformer, prompt: list[int]) -> list[int]:
    engine = make_engine(model)
    out = submit(engine, prompt)
    engine.run_until_idle()
    return tokens(out)


def test_a_short_request_starts_within_one_step_of_a_long_prefill(model: Transformer) -> None:
    engine = make_engine(model)
    long = submit(engine, LONG)
    engine.step()  # the long prompt is running, mid-prefill
    short = submit(engine, SHORT)
    steps = 0
    while not short:
        engine.step()
        steps += 1
    assert steps == 1, f"the short request waited {steps} steps for its first token"
    assert not long, "the long prompt should still be prefilling"
    engine.run_until_idle()
    assert short[-1].finish_reason == "length" and long[-1].finish_reason == "length"
    assert tokens(short) == alone(model, SHORT)
    assert tokens(long) == alone(model, LONG)
    assert engine.pool.num_used_blocks == 0 or engine.pool.enable_prefix_caching


def test_a_long_prefill_alone_takes_the_whole_budget(model: Transformer) -> None:
    """With nothing waiting no budget is held back: ten steps of 64 tokens, then decoding."""
    engine = make_engine(model)
    long = submit(engine, LONG)
    steps = 0
    while not long:
        engine.step()
        steps += 1
    assert steps == len(LONG) // BUDGET
