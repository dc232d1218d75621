"""Serving semantics of the diffusion decoder through the engine: what a client sees.

Streaming of the final left prefix, stop strings, EOS, max_tokens, seeds, logprobs, n,
infilling, metrics, token budgets and mixed phases in one forward, and the block pool being
whole again after every request (``run`` checks it). Tiny checkpoints, stand-in tokenizer.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from dualserve.decoders.diffusion.decoder import DiffusionConfig
from dualserve.decoders.diffusion.cache import DualCache, NoCache
from dualserve.decoders.diffusion.policies import LinearSchedule, LowConfidence
from dualserve.decoders.engine.compile.compile_worker import CompileWorker
from dualserve.decoders.engine.sampling import SamplingParams
from dualserve.models.loader import LoadedModel
from test_diffusion import (GREEDY, SMALL_MASK, SMALL_VOCAB, LetterTokenizer, Outcome, llada_reference, load_tiny,
                            make_engine, prompt, run, write_tiny_twin)
from tiny_checkpoints import write_tiny_llada

# Two tokens per step in units of four: several steps per unit, several commits per request.
CONFIG = DiffusionConfig(block_length=4, policy=LowConfidence(), schedule=LinearSchedule(2), cache=DualCache())
PARAMS = replace(GREEDY, max_tokens=12)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llada(tmp_path_factory) -> LoadedModel:
    return load_tiny(write_tiny_llada(tmp_path_factory.mktemp("llada"), vocab_size=SMALL_VOCAB,
                                      mask_token_id=SMALL_MASK))


@pytest.fixture(scope="module")
def twin(tmp_path_factory) -> LoadedModel:
    return load_tiny(write_tiny_twin(tmp_path_factory.mktemp("twin")))


@pytest.fixture(scope="module")
def full(llada: LoadedModel) -> Outcome:
    """The uninterrupted greedy answer the stopping tests cut."""
    return run(make_engine(llada, CONFIG), [prompt(5)], PARAMS)[0]


def test_final_prefix_streams_with_metrics(full: Outcome) -> None:
    assert full.finish_reason == "length" and len(full.tokens) == 12
    assert full.deltas >= 3  # at least one delta per unit, not one at the end
    assert full.text == LetterTokenizer().decode(full.tokens)
    assert full.stats["forward_passes"] == 6 and full.stats["tokens_per_forward"] == 2.0
    assert full.stats["steps_per_block"] == [2, 2, 2]


def test_stop_string_trims_exactly(llada: LoadedModel, full: Outcome) -> None:
    stop = full.text[7:10]  # starts inside the fourth token
    cut = full.text.find(stop)
    out = run(make_engine(llada, CONFIG), [prompt(5)], replace(PARAMS, stop=(stop,)))[0]
    assert out.finish_reason == "stop" and out.text == full.text[:cut]
    assert out.stats["forward_passes"] <= full.stats["forward_passes"]


def test_eos_stops_generation_early(llada: LoadedModel, full: Outcome) -> None:
    eos = full.tokens[5]
    end = full.tokens.index(eos) + 1
    out = run(make_engine(llada, CONFIG, tokenizer=LetterTokenizer([eos])), [prompt(5)], PARAMS)[0]
    assert out.finish_reason == "stop" and out.tokens == full.tokens[:end]
    assert out.stats["forward_passes"] < full.stats["forward_passes"]
    ignored = run(make_engine(llada, CONFIG, tokenizer=LetterTokenizer([eos])), [prompt(5)],
                  replace(PARAMS, ignore_eos=True))[0]
    assert ignored.tokens == full.tokens


@pytest.mark.parametrize("max_tokens", [1, 5, 11])
def test_max_tokens_is_the_canvas_budget(llada: LoadedModel, twin: LoadedModel, max_tokens: int) -> None:
    for loaded, config in ((llada, CONFIG), (twin, None)):
        out = run(make_engine(loaded, config), [prompt(6)], replace(PARAMS, max_tokens=max_tokens))[0]
        assert out.finish_reason == "length" and len(out.tokens) == max_tokens
        assert SMALL_MASK not in out.tokens


def test_seed_reproducibility(llada: LoadedModel, twin: LoadedModel) -> None:
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=7)
    for loaded, config in ((llada, CONFIG), (twin, None)):
        a = run(make_engine(loaded, config), [prompt(5)], sampled)[0].tokens
        batched = run(make_engine(loaded, config), [prompt(5), prompt(9, seed=1)], sampled)[0].tokens
        other = run(make_engine(loaded, config), [prompt(5)], replace(sampled, seed=8))[0].tokens
        assert a == batched != other


def test_random_remasking_follows_the_seed(llada: LoadedModel) -> None:
    """LLaDA's "random" remasking: the order of unmasking is drawn from the request's generator."""
    config = replace(CONFIG, confidence="random")
    seeded = replace(PARAMS, seed=5)
    a, b = (run(make_engine(llada, config), [prompt(5)], seeded)[0].tokens for _ in range(2))
    others = {tuple(run(make_engine(llada, config), [prompt(5)], replace(seeded, seed=s))[0].tokens) for s in (6, 7)}
    assert a == b and len(a) == 12
    assert others != {tuple(a)}


def test_plan_is_pure_and_step_runs_what_it_sized(llada: LoadedModel) -> None:
    """The scheduler may plan a request and not run it: planning creates no state."""
    engine = make_engine(llada, CONFIG)
    decoder = engine.decoders[("m", "diffusion")]
    outcomes = []
    engine.submit("m", "diffusion", prompt(5), PARAMS, sink=lambda i, d: outcomes.append(d))
    engine.step()  # admits the request: its first forward runs
    req = engine.scheduler.running[0]
    planned = decoder.plan(req, 512)
    assert decoder.plan(req, 512) == planned and decoder.plan(req, 0) == (0, 0)
    fresh = replace(req, output_ids=[], table=type(req.table)(), decoder_state=None)
    fresh_plan = decoder.plan(fresh, 512)
    assert fresh.decoder_state is None and fresh.table.blocks == [] and fresh_plan[0] > 0
    engine.run_until_idle()
    assert outcomes[-1].finish_reason == "length"


def test_logprobs_for_committed_tokens(llada: LoadedModel) -> None:
    out = run(make_engine(llada, CONFIG), [prompt(5)], replace(PARAMS, logprobs=2))[0]
    assert [lp.token_id for lp in out.logprobs] == out.tokens
    for lp in out.logprobs:
        assert len(lp.top) == 2 and lp.logprob <= 0.0
        assert lp.top[0][1] >= lp.logprob - 1e-6


def test_n_choices_are_separate_requests(llada: LoadedModel) -> None:
    outs = run(make_engine(llada, CONFIG), [prompt(5)], SamplingParams(max_tokens=8, temperature=1.0, seed=3), n=2)
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert outs[0].tokens != outs[1].tokens


@pytest.mark.parametrize("penalty", [{"presence_penalty": 0.5}, {"frequency_penalty": -1.0},
                                     {"repetition_penalty": 1.3}])
def test_penalties_apply_and_spare_neighbours(llada: LoadedModel, twin: LoadedModel, penalty: dict) -> None:
    """The penalty state is built inside the step's inference mode and updated by commit outside
    it (issue 15): penalised requests and their batch neighbours all finish."""
    for loaded, config in ((llada, CONFIG), (twin, None)):
        alone = run(make_engine(loaded, config), [prompt(6)], PARAMS)[0]
        engine = make_engine(loaded, config)
        penalised = replace(PARAMS, temperature=0.7, seed=5, **penalty)
        outs = [Outcome(), Outcome()]
        for out, params in zip(outs, (penalised, PARAMS)):
            def sink(_: int, delta, out: Outcome = out) -> None:
                out.tokens += delta.token_ids
                out.finish_reason, out.error = delta.finish_reason, delta.error
            engine.submit("m", "diffusion", prompt(6), params, sink)
        engine.run_until_idle()
        assert [o.finish_reason for o in outs] == ["length", "length"], outs[0].error
        assert outs[1].tokens == alone.tokens


def test_infill_sees_the_suffix(llada: LoadedModel) -> None:
    config = DiffusionConfig(block_length=4, policy=LowConfidence(), schedule=LinearSchedule(4), cache=NoCache())
    p, suffix = prompt(5), prompt(4, seed=20)
    params = replace(GREEDY, max_tokens=8)
    out = run(make_engine(llada, config), [p], params, suffixes=[suffix])[0]
    assert out.tokens == llada_reference(llada.model, p, 8, 4, 8, SMALL_MASK, suffix=suffix)
    assert out.tokens != llada_reference(llada.model, p, 8, 4, 8, SMALL_MASK)
    dual = run(make_engine(llada, CONFIG), [p], params, suffixes=[suffix])[0]
    assert dual.finish_reason == "length" and len(dual.tokens) == 8


def test_infill_on_a_block_causal_model_is_an_error(twin: LoadedModel) -> None:
    out = run(make_engine(twin), [prompt(5)], PARAMS, suffixes=[[1, 2, 3]])[0]
    assert out.finish_reason == "error" and "bidirectional" in out.error and out.tokens == []


def test_sequence_larger_than_the_pool_is_an_error(llada: LoadedModel) -> None:
    out = run(make_engine(llada, CONFIG, num_blocks=2, block_size=4), [prompt(5)], PARAMS)[0]
    assert out.finish_reason == "error"


def test_spans_over_the_token_budget_run_alone(llada: LoadedModel) -> None:
    """A bidirectional forward cannot be split: over-budget spans wait for a step of their own."""
    prompts = [prompt(5), prompt(9, seed=1)]
    tight = run(make_engine(llada, CONFIG, max_batched_tokens=16), prompts, PARAMS)
    assert [o.tokens for o in tight] == [o.tokens for o in run(make_engine(llada, CONFIG), prompts, PARAMS)]


def test_requests_in_different_phases_share_forwards(llada: LoadedModel, twin: LoadedModel) -> None:
    for loaded, config in ((llada, CONFIG), (twin, None)):
        engine = make_engine(loaded, config)
        outs = {0: Outcome(), 1: Outcome()}

        def sink_for(i):
            def sink(_index, delta):
                outs[i].tokens += delta.token_ids
                if delta.finish_reason:
                    outs[i].stats = delta.stats
            return sink

        engine.submit("m", "diffusion", prompt(5), PARAMS, sink_for(0))
        engine.step()
        engine.step()
        engine.submit("m", "diffusion", prompt(9, seed=1), PARAMS, sink_for(1))
        engine.run_until_idle()
        forwards = outs[0].stats["forward_passes"] + outs[1].stats["forward_passes"]
        assert engine.stats.steps < forwards  # some steps ran both requests in one forward
        alone = run(make_engine(loaded, config), [prompt(5), prompt(9, seed=1)], PARAMS)
        assert [outs[0].tokens, outs[1].tokens] == [o.tokens for o in alone]
        assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_block_causal_requests_grow_and_survive_preemption(twin: LoadedModel) -> None:
    """Block-causal requests reserve block by block; a full pool preempts one, which resumes."""
    params = replace(PARAMS, max_tokens=40)
    outs = run(make_engine(twin, num_blocks=4), [prompt(5), prompt(6, seed=1)], params)
    assert [(o.finish_reason, len(o.tokens)) for o in outs] == [("length", 40), ("length", 40)]
    assert sum(o.stats["preemptions"] for o in outs) > 0


@pytest.mark.slow
def test_structured_output_survives_preemption(default_gguf, cache_dir) -> None:
    """A grammar's state rolls back to the committed prefix when a preempted request restarts."""
    import json

    from dualserve.decoders.training.diffusion_data import chat_prompt_ids
    from dualserve.decoders.engine.grammar import GrammarSpec
    from dualserve.models.assets import default_twin
    from dualserve.models.loader import load_model

    base = load_model(default_gguf, cache_dir=cache_dir)
    twin = load_model(default_twin(base.name), name="m", cache_dir=cache_dir)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    params = replace(GREEDY, max_tokens=40, grammar=GrammarSpec("json_schema", json.dumps(schema)))
    prompts = [chat_prompt_ids(base, f"Make up a person called {n} as JSON.") for n in ("Ada", "Bo")]
    tight = run(make_engine(twin, num_blocks=6), prompts, params)
    roomy = run(make_engine(twin, num_blocks=64), prompts, params)
    assert sum(o.stats["preemptions"] for o in tight) > 0
    assert [o.tokens for o in tight] == [o.tokens for o in roomy]
    for o in tight:
        assert o.finish_reason == "stop"
        assert set(json.loads(o.text)) == {"name", "age"}


class QueueingWorker(CompileWorker):
    """A compile worker that records the graphs asked for and builds nothing (a real build is a
    minute of a core per graph; what is queued, and when, is the point here)."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[str | None] = []

    def submit(self, job, name=None) -> None:
        self.asked.append(name)


def test_twin_graphs_are_asked_for_by_the_first_diffusion_step(twin: LoadedModel, tmp_path) -> None:
    """A first start queues the target's graphs; the twin's are queued by the first ``diffusion``
    step that needs them (until built, it runs eager), not at start."""
    from dualserve.decoders.deployment import CompileSpec, PoolSpec, ServedSpec, build_deployment
    from dualserve.models.loader import load_model
    from tiny_twin import write_tiny_llama

    base = load_model(write_tiny_llama(tmp_path / "base"), cache_dir=tmp_path / "cache")
    worker = QueueingWorker()
    dep = build_deployment([ServedSpec("m", base, twin=twin)], pool=PoolSpec(block_size=4, num_blocks=64),
                           compile=CompileSpec(worker=worker))
    target = dep.engine.decoders[("m", "ar")].runner.compiled
    twin_step = dep.engine.decoders[("m", "diffusion")].runner.compiled
    assert worker.asked == ["rows", "chunks"]
    assert {shape.name for shape, _ in target._pending} == {"rows", "chunks"} and not twin_step._pending
    dep.engine.submit("m", "diffusion", prompt(5), replace(PARAMS, max_tokens=4), lambda *_: None)
    dep.engine.run_until_idle()
    assert "rows" in {shape.name for shape, _ in twin_step._pending} and worker.asked[2:]
