"""Failure isolation in the engine: a request that raises fails alone, its neighbours finish.

Tiny random models with a stand-in tokenizer run real steps on each decoder (ar, eagle with a
random head, diffusion on a tiny LLaDA). Faults are injected where the engine meets a decoder:
a plan that raises for one request, a forward that raises whenever one request is in the batch
(the engine cannot tell which: it bisects), sampling that raises for one request's own values,
and a draft or denoising step that raises for one request. The reference for the neighbours is
the same requests run without the bad one: isolation must not change a single token.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch

from dualserve.decoders.ar import ARDecoder
from dualserve.decoders.diffusion.decoder import DiffusionDecoder
from dualserve.decoders.eagle.decoder import EagleDecoder
from dualserve.decoders.eagle.tree import TreeConfig
from dualserve.decoders.engine.engine import Engine, EngineConfig
from dualserve.decoders.engine.request import Delta, FailureKind
from dualserve.decoders.engine.runner import ModelRunner
from dualserve.decoders.engine.sampling import SamplingParams
from dualserve.models.config import ModelConfig
from dualserve.models.families import read_config
from dualserve.models.eagle import Eagle1Head, EagleConfig
from dualserve.models.loader import build, load_hf_state
from dualserve.models.transformer import Transformer
from tiny_checkpoints import write_tiny_llada

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64
POISON = 2  # a sequence holding this token makes the injected faults fire (the good ones never do)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16], [17]]


class Tok:
    eos_token_ids = [0]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


class PlanFails(ARDecoder):
    def plan(self, req, budget):
        if POISON in req.prompt_ids:
            raise RuntimeError("plan broke")
        return super().plan(req, budget)


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(family="llama", vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, intermediate_size=48)
    return Transformer(cfg).eval().requires_grad_(False)


class DraftFails(EagleDecoder):
    def _draft(self, s, *planned):
        if POISON in s.request.prompt_ids:
            raise RuntimeError("draft broke")
        return super()._draft(s, *planned)


class DenoiseFails(DiffusionDecoder):
    def _denoise(self, req, st, rows, query_start):
        if POISON in req.prompt_ids:
            raise RuntimeError("denoising broke")
        return super()._denoise(req, st, rows, query_start)


@pytest.fixture(scope="module")
def llada(tmp_path_factory) -> Transformer:
    path = write_tiny_llada(tmp_path_factory.mktemp("llada"), vocab_size=VOCAB, mask_token_id=VOCAB - 1)
    config = read_config(json.loads((path / "config.json").read_text()))
    return build(config, load_hf_state(path, config), torch.float32, "cpu")


def make_engine(model: Transformer, decoder_type=ARDecoder, poison_forward: bool = False) -> Engine:
    """An engine serving ``model`` with one decoder (an ``ARDecoder``, ``EagleDecoder`` or
    ``DiffusionDecoder`` kind), named "m"; ``poison_forward``: any forward over POISON raises."""
    engine = Engine(EngineConfig(num_blocks=128, block_size=4))
    runner = ModelRunner(model, 128, 4, use_flash=False)
    if poison_forward:
        forward = runner.forward

        def poisoned(items, *args, **kwargs):
            if any(POISON in list(map(int, it.token_ids)) for it in items):
                raise RuntimeError("forward broke")
            return forward(items, *args, **kwargs)

        runner.forward = poisoned
    if issubclass(decoder_type, EagleDecoder):
        cfg = model.config
        head = Eagle1Head(EagleConfig("eagle1", cfg.replace(num_layers=1), cfg.hidden_size, cfg.vocab_size))
        head.rotary.reset("cpu")
        head = head.attach(model).eval().requires_grad_(False)
        decoder = decoder_type(runner, engine.pool, head, TreeConfig(depth=2, top_k=2, num_nodes=4))
    else:
        decoder = decoder_type(runner, engine.pool)
    engine.add_decoder("m", decoder, Tok(), VOCAB)
    return engine


def run(engine: Engine, jobs: list[tuple[list[int], SamplingParams]]) -> list[list[Delta]]:
    outs: list[list[Delta]] = [[] for _ in jobs]
    (name,) = engine.decoders_for("m")
    for i, (prompt, params) in enumerate(jobs):
        engine.submit("m", name, prompt, params, lambda _, d, i=i: outs[i].append(d))
    engine.run_until_idle()
    assert engine.pool.num_used_blocks == 0 or engine.pool.enable_prefix_caching
    engine.pool.check()
    return outs


def tokens(deltas: list[Delta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def check_isolated(engine: Engine, reference: Engine, bad: tuple[list[int], SamplingParams]) -> Delta:
    """One bad request in the middle of good ones: it fails alone, they match the reference."""
    good = [(p, GREEDY) for p in PROMPTS]
    outs = run(engine, good[:2] + [bad] + good[2:])
    failed = outs.pop(2)
    assert failed[-1].finish_reason == "error" and failed[-1].failure is FailureKind.INTERNAL
    assert "internal error" in failed[-1].error
    expected = run(reference, good)
    assert [o[-1].finish_reason for o in outs] == ["length"] * len(PROMPTS)
    assert [tokens(o) for o in outs] == [tokens(o) for o in expected]
    return failed[-1]


def test_a_plan_that_raises_fails_only_its_request(model: Transformer) -> None:
    check_isolated(make_engine(model, PlanFails), make_engine(model), ([POISON, 3, 4], GREEDY))


def test_a_forward_that_raises_is_bisected_to_its_request(model: Transformer) -> None:
    """The forward fails whenever the bad request is in the batch; the others still finish, both
    when it breaks at once (prefill) and when it breaks later (its prompt decodes into POISON)."""
    engine = make_engine(model, poison_forward=True)
    check_isolated(engine, make_engine(model), ([3, 4, POISON], GREEDY))
    late = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logit_bias={POISON: 100.0})
    check_isolated(engine, make_engine(model), ([3, 4], late))  # fails on its first decode step


def test_shared_logits_that_raise_once_are_retried_from_an_unchanged_state(model: Transformer) -> None:
    """The step's shared logits are computed before any request's state moves, so a retry of
    the batch (isolation.py) continues exactly where it was."""
    engine = make_engine(model)
    runner = engine.decoders[("m", "ar")].runner
    logits, calls = runner.logits, []

    def broken_once(hidden):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("logits broke")
        return logits(hidden)

    runner.logits = broken_once
    outs = run(engine, [(p, GREEDY) for p in PROMPTS])
    assert [tokens(o) for o in outs] == [tokens(o) for o in run(make_engine(model), [(p, GREEDY) for p in PROMPTS])]
    assert all(o[-1].finish_reason == "length" for o in outs)


def test_sampling_that_raises_fails_only_its_request(model: Transformer) -> None:
    """A logit bias outside the vocabulary (the server refuses it; the engine must not trust that)."""
    bad = SamplingParams(max_tokens=8, temperature=0.5, seed=1, logit_bias={10 ** 6: 1.0})
    check_isolated(make_engine(model), make_engine(model), ([3, 4, 5], bad))


@pytest.mark.parametrize("decoder", [DraftFails, EagleDecoder])
def test_eagle_isolates_a_failing_draft_and_a_failing_forward(model: Transformer, decoder) -> None:
    check_isolated(make_engine(model, decoder, poison_forward=decoder is EagleDecoder),
                   make_engine(model, EagleDecoder), ([3, 4, POISON], GREEDY))


@pytest.mark.parametrize("decoder", [DenoiseFails, DiffusionDecoder])
def test_diffusion_isolates_a_failing_denoise_and_a_failing_forward(llada: Transformer, decoder) -> None:
    check_isolated(make_engine(llada, decoder, poison_forward=decoder is DiffusionDecoder),
                   make_engine(llada, DiffusionDecoder), ([3, 4, POISON], GREEDY))


def test_a_failure_in_one_request_never_stops_the_engine_thread(model: Transformer) -> None:
    """On the engine's own thread: the bad request's error is delivered, later requests are served."""
    engine = make_engine(model, PlanFails)
    engine.start()
    try:
        done: dict[int, Delta] = {}
        finished = threading.Event()

        def sink(i: int):
            def put(_: int, d: Delta) -> None:
                if d.finish_reason is not None:
                    done[i] = d
                    if len(done) == 3:
                        finished.set()
            return put

        for i, prompt in enumerate([[POISON], PROMPTS[0], PROMPTS[1]]):
            engine.submit("m", "ar", prompt, GREEDY, sink(i))
        assert finished.wait(60)
        assert [done[i].finish_reason for i in range(3)] == ["error", "length", "length"]
    finally:
        engine.shutdown()
