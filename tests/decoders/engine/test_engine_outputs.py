"""The engine in-process: stops, usage, penalties, logprobs and a failing step, on the harness of
``test_engine.py`` (``tests/engine_harness.py``)."""

from __future__ import annotations

import pytest
import torch

from dualserve.decoders.engine.sampling import SamplingParams
from dualserve.models.attention import DenseAttention
from dualserve.models.transformer import Transformer
from engine_harness import (  # noqa: F401  (fixtures)
    MODEL, GREEDY, TINY, Client, alone, built, count_forwarded, make_engine, random_prompts, real, tiny, tokenizer)


# ---- stops, usage, penalties and logprobs through the engine ----------------------------------

def test_stops_and_usage_through_the_engine(make_engine, tokenizer):
    prompt = random_prompts(1, 10, 11, seed=10)[0]
    ref = alone(make_engine(), [prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    text = tokenizer.decode(ref, skip_special_tokens=True)
    stop = tokenizer.decode(ref[6:8])
    assert stop and stop in text
    need = next(k for k in range(1, 21) if stop in tokenizer.decode(ref[:k]))
    engine = make_engine()
    client = Client(engine)
    by_string = client.submit(prompt, SamplingParams(max_tokens=20, temperature=0.0, stop=(stop,)))
    by_token = client.submit(prompt, SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=(ref[4],)))
    by_length = client.submit(prompt, SamplingParams(max_tokens=5, temperature=0.0))
    engine.run_until_idle()
    assert client.text(by_string) == text[:text.index(stop)]
    assert client.tokens(by_string) == ref[:need] and client.final(by_string).finish_reason == "stop"
    assert client.tokens(by_token) == ref[:ref.index(ref[4]) + 1]
    assert client.final(by_token).finish_reason == "stop"
    assert client.tokens(by_length) == ref[:5] and client.final(by_length).finish_reason == "length"


def test_bias_and_penalties_act_on_every_step(make_engine):
    engine = make_engine()
    client = Client(engine)
    forced = client.submit([5, 6, 7], SamplingParams(max_tokens=6, temperature=0.0, logit_bias={4242: 100.0}))
    fresh = client.submit([5, 6, 7], SamplingParams(max_tokens=30, temperature=0.0, presence_penalty=2.0,
                                                     frequency_penalty=2.0, ignore_eos=True))
    engine.run_until_idle()
    assert client.tokens(forced) == [4242] * 6
    tokens = client.tokens(fresh)
    assert len(set(tokens)) == len(tokens) == 30, "a seen token is penalised below the rest"


def dense_logprobs(model: Transformer, ids: list[int]) -> torch.Tensor:
    """(len(ids), vocab) log-probabilities of the next token after each position, one dense forward."""
    with torch.inference_mode():
        hidden, _ = model(torch.tensor(ids), torch.arange(len(ids)), DenseAttention([len(ids)]))
        return torch.log_softmax(model.logits(hidden), -1)


def test_generated_logprobs_match_a_dense_forward(make_engine, tiny):
    prompt = random_prompts(1, 12, 13, seed=11)[0]
    engine = make_engine()
    client = Client(engine)
    rid = client.submit(prompt, SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True))
    engine.run_until_idle()
    lps = [lp for d in client.deltas[(rid, 0)] for lp in (d.logprobs or [])]
    out = client.tokens(rid)
    ref = dense_logprobs(tiny, prompt + out)
    assert [lp.token_id for lp in lps] == out
    for j, lp in enumerate(lps):
        row = ref[len(prompt) - 1 + j]
        assert lp.logprob == pytest.approx(row[lp.token_id].item(), abs=1e-4)
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id  # greedy picks the top one
        assert [v for _, v in lp.top] == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)


def test_prompt_logprobs_bypass_the_prefix_cache(make_engine, tiny):
    prompt = random_prompts(1, 30, 31, seed=12)[0]
    ref = dense_logprobs(tiny, prompt)
    engine = make_engine(max_batched_tokens=8)  # the prompt takes four chunks
    client = Client(engine)
    client.submit(prompt)  # fills the prefix cache with this prompt's blocks
    engine.run_until_idle()
    rid = client.submit(prompt, SamplingParams(max_tokens=3, temperature=0.0, logprobs=2, prompt_logprobs=True),
                        n=2)
    engine.run_until_idle()
    for index in range(2):
        first = client.deltas[(rid, index)][0]
        got = first.prompt_logprobs
        assert got is not None and len(got) == len(prompt) and got[0] is None
        for pos, lp in enumerate(got[1:], start=1):
            assert lp.token_id == prompt[pos]
            assert lp.logprob == pytest.approx(ref[pos - 1, prompt[pos]].item(), abs=1e-4)
            assert len(lp.top) == 2
        assert all(d.prompt_logprobs is None for d in client.deltas[(rid, index)][1:])
    assert client.final(rid, 0).stats["cached_prompt_tokens"] == 0, "the whole prompt was computed"
    assert client.final(rid, 1).stats["cached_prompt_tokens"] == 28, "choice 1 copied choice 0's values"
    assert client.tokens(rid, 0) == client.tokens(rid, 1)


def test_prompt_logprobs_survive_chunking_and_preemption(make_engine, tiny):
    prompts = random_prompts(4, 20, 36, seed=13)
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=0, prompt_logprobs=True, ignore_eos=True)
    engine = make_engine(num_blocks=24, max_batched_tokens=12)
    client = Client(engine)
    rids = [client.submit(p, params) for p in prompts]
    engine.run_until_idle()
    assert engine.scheduler.num_preemptions > 0
    for rid, prompt in zip(rids, prompts):
        ref = dense_logprobs(tiny, prompt)
        got = client.deltas[(rid, 0)][0].prompt_logprobs
        assert [lp.token_id for lp in got[1:]] == prompt[1:]
        assert [lp.logprob for lp in got[1:]] == pytest.approx(
            [ref[pos - 1, prompt[pos]].item() for pos in range(1, len(prompt))], abs=1e-4)


def test_a_failing_step_is_retried_and_the_engine_goes_on(make_engine):
    """A forward that fails once is retried without failing anyone (isolation.py bisects it);
    tests/decoders/engine/test_isolation.py covers requests that fail every time."""
    engine = make_engine()
    runner = engine.decoders[(MODEL, "ar")].runner
    forward = runner.forward
    calls = []

    def broken_once(items, *args, **kwargs):
        calls.append(len(items))
        if len(calls) == 2:
            raise RuntimeError("device lost")
        return forward(items, *args, **kwargs)

    prompts = random_prompts(2, 5, 9)
    expected = alone(make_engine(), prompts)
    runner.forward = broken_once
    client = Client(engine)
    rids = [client.submit(p) for p in prompts]
    engine.run_until_idle()
    assert [client.tokens(rid) for rid in rids] == expected
    assert all(client.final(rid).finish_reason == "length" for rid in rids)
    after = client.submit([3, 4, 5])
    engine.run_until_idle()
    assert len(client.tokens(after)) == GREEDY.max_tokens
