"""The EAGLE step's bookkeeping: each request's budget is consulted once a step, and a batch that
mixes prefill chunks, plain steps and trees (under a budget that sizes them) stays token-identical
to ``ar``."""

from __future__ import annotations

import pytest

from dualserve.decoders.ar import ARDecoder
from dualserve.decoders.eagle.budget import Budget, CostCurve
from dualserve.decoders.eagle.decoder import EagleDecoder
from dualserve.decoders.eagle.tree import TreeConfig
from dualserve.decoders.engine.engine import Engine, EngineConfig
from dualserve.decoders.engine.runner import ModelRunner
from dualserve.decoders.engine.sampling import SamplingParams
from test_eagle import GREEDY, PROMPTS, Tok, oracle_head, run, tiny_target, tokens

pytestmark = pytest.mark.usefixtures("one_thread")


class CountingBudget(EagleDecoder):
    """An ``EagleDecoder`` that records the request and length at which its budget chose a draft."""

    consulted: list[tuple[str, int]]

    def _budget(self, req, cap: int) -> Budget:
        choose = self.budget.choose

        def counted(*args, **kwargs) -> Budget:
            self.consulted.append((req.request_id, req.num_tokens))
            return choose(*args, **kwargs)

        self.budget.choose = counted
        try:
            return super()._budget(req, cap)
        finally:
            self.budget.choose = choose


def engine_with(decoder_type: type[EagleDecoder], cost: CostCurve | None) -> tuple[Engine, EagleDecoder]:
    target = tiny_target(2, 0.3)
    engine = Engine(EngineConfig(num_blocks=256, block_size=4, max_batched_tokens=16))
    runner = ModelRunner(target, 256, 4)
    engine.add_decoder("m", ARDecoder(runner, engine.pool), Tok())
    eagle = decoder_type(runner, engine.pool, oracle_head(target, noise=0.05, seed=3), TreeConfig(4, 2, 8), cost=cost)
    engine.add_decoder("m", eagle, Tok())
    return engine, eagle


@pytest.mark.parametrize("cost", [None, CostCurve(1.0, 2.0)])
def test_the_budget_is_consulted_once_a_step(cost: CostCurve | None) -> None:
    engine, eagle = engine_with(CountingBudget, cost)
    eagle.consulted = []
    run(engine, [("eagle", p, GREEDY) for p in PROMPTS])
    assert eagle.consulted, "no step drafted"
    assert len(eagle.consulted) == len(set(eagle.consulted)), "a request's budget was chosen twice at one length"


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True)])
def test_chunked_prefills_beside_trees_match_ar(params: SamplingParams) -> None:
    engine, _ = engine_with(EagleDecoder, CostCurve(1.0, 1.0))  # a flat curve: trees pay
    long_prompt = list(range(3, 40))  # prefilled in chunks of the step's 16 tokens, beside decoding requests
    prompts = PROMPTS + [long_prompt]
    outs = run(engine, [(d, p, params) for p in prompts for d in ("ar", "eagle")])
    for i in range(0, len(outs), 2):
        assert tokens(outs[i + 1]) == tokens(outs[i])
    engine.pool.check()
