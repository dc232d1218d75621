"""The engine in-process: continuous batching, prefix cache, preemption, chunking, abort, n, seeds.

Most tests drive ``Engine.step`` / ``run_until_idle`` on a tiny random Llama-style model that
shares the default model's tokenizer (so stop strings and detokenization are real); the
``slow`` ones use the default model itself. The reference for "correct" is always the same
request run alone in an unconstrained engine: batching, chunking, preemption and prefix
sharing must not change a single token. After every test each engine it built must be idle
with every block back in its pool.
"""

from __future__ import annotations

import time

import pytest
import torch

from dualserve.decoders.engine.request import FailureKind
from dualserve.decoders.engine.sampling import SamplingParams
from dualserve.decoders.engine.scheduler import QueueFull
from dualserve.models import kernels
from dualserve.models.checkpoint import build
from engine_harness import (  # noqa: F401  (fixtures)
    MODEL, GREEDY, TINY, Client, alone, built, count_forwarded, make_engine, random_prompts, real, tiny, tokenizer)


# ---- batching ---------------------------------------------------------------------------

def test_batching_never_changes_greedy_tokens(make_engine):
    """24 requests arrive in waves while others decode, with small prefill chunks."""
    prompts = random_prompts(24, 3, 40)
    params = [SamplingParams(max_tokens=4 + i % 9, temperature=0.0, ignore_eos=True) for i in range(24)]
    reference = [alone(make_engine(enable_prefix_caching=False), [p], q)[0] for p, q in zip(prompts, params)]
    engine = make_engine(max_batched_tokens=48)
    client = Client(engine)
    rids = []
    for wave in range(4):
        rids += [client.submit(p, q) for p, q in zip(prompts[wave * 6:(wave + 1) * 6], params[wave * 6:])]
        engine.step()
        engine.step()
    engine.run_until_idle()
    assert [client.tokens(r) for r in rids] == reference
    assert all(client.final(r).finish_reason == "length" for r in rids)


@pytest.mark.slow
def test_batch_invariance_on_the_default_model(make_engine, real):
    """16 concurrent greedy requests of varied lengths equal their one-at-a-time outputs."""
    tok = real.tokenizer
    topics = ["the history of Rome", "how a CPU cache works", "baking bread", "the rules of chess",
              "why the sky is blue", "writing a haiku", "the water cycle", "sorting algorithms"]
    texts = [f"Question {i}: explain {topics[i % 8]}" + " in plain words, step by step," * (i % 4) + "\nAnswer:"
             for i in range(16)]
    prompts = [tok.encode(t, add_special_tokens=True) for t in texts]
    assert len({len(p) for p in prompts}) >= 8
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    reference = alone(make_engine(real.model, block_size=16, enable_prefix_caching=False), prompts, params)
    engine = make_engine(real.model, block_size=16)
    client = Client(engine)
    rids = [client.submit(p, params) for p in prompts[:8]]
    engine.step()
    engine.step()
    rids += [client.submit(p, params) for p in prompts[8:]]  # join a batch already decoding
    engine.run_until_idle()
    assert [client.tokens(r) for r in rids] == reference


@pytest.mark.slow
def test_prefix_cache_and_chunks_on_the_default_model(make_engine, real):
    tok = real.tokenizer
    system = "You are a careful assistant. Answer briefly and cite the rule you used. " * 3
    first = tok.encode(system + "Q: What is two plus two?\nA:", add_special_tokens=True)
    second = tok.encode(system + "Q: Name a prime number.\nA:", add_special_tokens=True)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    reference = alone(make_engine(real.model, block_size=16, enable_prefix_caching=False), [second], params)[0]
    engine = make_engine(real.model, block_size=16, max_batched_tokens=32)  # the prompts take 2-3 chunks
    client = Client(engine)
    client.submit(first, params)
    engine.run_until_idle()
    rid = client.submit(second, params)
    engine.run_until_idle()
    shared = next(i for i, (x, y) in enumerate(zip(first, second)) if x != y)
    assert shared >= 32
    assert client.final(rid).stats["cached_prompt_tokens"] == shared // 16 * 16  # every full shared block
    assert client.tokens(rid) == reference


# ---- prefix cache -------------------------------------------------------------------------

def test_a_shared_prefix_is_prefilled_once(make_engine):
    prefix = random_prompts(1, 40, 41, seed=1)[0]
    a, b = prefix + [11, 12, 13, 14, 15], prefix + [21, 22, 23, 24, 25, 26, 27]
    reference = alone(make_engine(enable_prefix_caching=False), [b])[0]
    engine = make_engine()
    client = Client(engine)
    client.submit(a)
    engine.run_until_idle()
    hits_before = engine.pool.stats.hits
    forwarded = count_forwarded(engine)
    rid = client.submit(b)
    engine.run_until_idle()
    assert client.final(rid).stats["cached_prompt_tokens"] == 40  # ten full blocks of 4
    assert engine.pool.stats.hits - hits_before == 40
    # Only the 7 new prompt tokens are prefilled, then one token per decode step.
    assert forwarded == [7] + [1] * (GREEDY.max_tokens - 1)
    assert client.tokens(rid) == reference


# ---- memory pressure and chunking -------------------------------------------------------

def test_a_pool_too_small_preempts_and_still_answers_right(make_engine):
    prompts = random_prompts(8, 10, 30, seed=2)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    reference = alone(make_engine(enable_prefix_caching=False), prompts, params)
    for prefix_caching in (True, False):
        # Each request needs up to 13 blocks of 4; 8 at once would need about 80.
        engine = make_engine(num_blocks=30, enable_prefix_caching=prefix_caching)
        client = Client(engine)
        rids = [client.submit(p, params) for p in prompts]
        engine.run_until_idle()
        assert engine.scheduler.num_preemptions > 0
        assert [client.tokens(r) for r in rids] == reference
        assert sum(client.final(r).stats["preemptions"] for r in rids) == engine.scheduler.num_preemptions
        assert all(len(client.tokens(r)) == 20 for r in rids), "usage counts each token once despite recompute"


def test_long_prompt_is_prefilled_in_chunks(make_engine):
    prompt = random_prompts(1, 150, 151, seed=3)[0]
    reference = alone(make_engine(), [prompt])[0]
    engine = make_engine(max_batched_tokens=16)
    forwarded = count_forwarded(engine)
    client = Client(engine)
    rid = client.submit(prompt)
    engine.run_until_idle()
    assert client.tokens(rid) == reference
    assert forwarded == [16] * 9 + [6] + [1] * (GREEDY.max_tokens - 1)


def test_decodes_keep_flowing_during_a_long_prefill(make_engine):
    engine = make_engine(max_batched_tokens=16)
    client = Client(engine)
    short = client.submit(random_prompts(1, 5, 6, seed=4)[0], SamplingParams(max_tokens=30, temperature=0.0))
    engine.step()
    long = client.submit(random_prompts(1, 200, 201, seed=5)[0])
    engine.step()
    # Put the long prefill ahead of the decode in the running list, as a re-admission after a
    # preemption can: the decode must still be served first.
    engine.scheduler.running.reverse()
    for _ in range(4):
        engine.step()
    assert len(client.tokens(short)) == 6, "the short request decoded on every step of the long prefill"
    assert client.tokens(long) == []
    engine.run_until_idle()


def test_a_prompt_larger_than_the_pool_fails_cleanly(make_engine):
    engine = make_engine(num_blocks=4)
    client = Client(engine)
    rid = client.submit(random_prompts(1, 40, 41)[0])
    ok = client.submit([5, 6, 7])
    engine.run_until_idle()
    final = client.final(rid)
    assert final.finish_reason == "error" and "pool" in final.error
    assert final.failure is FailureKind.CAPACITY
    assert len(client.tokens(ok)) == GREEDY.max_tokens


# ---- abort, overload, threading -------------------------------------------------------------

def test_abort_frees_blocks_within_one_step(make_engine):
    engine = make_engine(max_num_seqs=2)
    client = Client(engine)
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    running = client.submit(random_prompts(1, 30, 31)[0], params)
    other = client.submit([7, 8, 9], params)
    waiting = client.submit([1, 2, 3], params)  # max_num_seqs=2: stays queued
    held = client.submit([4, 5, 6, 7, 8], params, n=3)
    for _ in range(4):
        engine.step()
    assert client.tokens(running) and not client.tokens(waiting)
    for rid in (running, waiting, held):
        engine.abort(rid)
    engine.step()
    (req,) = engine.scheduler.running
    assert engine.pool.num_used_blocks == len(req.table.blocks), "only the surviving request holds blocks"
    for rid, index in [(running, 0), (waiting, 0), (held, 0), (held, 1), (held, 2)]:
        assert client.final(rid, index).finish_reason == "abort"
    engine.abort(other)
    engine.step()
    assert client.final(other).finish_reason == "abort" and engine.pool.num_used_blocks == 0


def test_the_waiting_queue_is_bounded(make_engine):
    engine = make_engine(max_waiting=3)
    client = Client(engine)
    client.submit([1, 2, 3])
    client.submit([4, 5, 6], n=2)
    with pytest.raises(QueueFull):
        client.submit([7, 8, 9])
    engine.step()
    client.submit([7, 8, 9])  # room again once the first ones run
    with pytest.raises(ValueError):
        engine.submit(MODEL, "ar", [], GREEDY, lambda i, d: None)
    engine.run_until_idle()


def test_a_choice_that_waits_too_long_fails_as_overloaded(make_engine):
    """max_queue_wait: a choice still waiting after it is failed (OVERLOADED) and leaves the queue;
    a running one goes on, and so does one that has started once (preempted back to waiting)."""
    engine = make_engine(max_num_seqs=1, max_queue_wait=0.2)
    client = Client(engine)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    running = client.submit([1, 2, 3], params)
    waiting = client.submit([4, 5, 6], params)
    engine.step()
    time.sleep(0.25)
    engine.step()
    final = client.final(waiting)
    assert final.finish_reason == "error" and final.failure is FailureKind.OVERLOADED
    assert "waited" in final.error and not client.tokens(waiting)
    assert not engine.scheduler.waiting and engine.num_queued() == 0
    (started,) = engine.scheduler.running
    engine.scheduler.preempt(started)  # it has streamed tokens: it waits on, however long
    time.sleep(0.25)
    engine.run_until_idle()
    assert client.final(running).finish_reason == "length" and len(client.tokens(running)) == 40


def test_the_estimated_wait_follows_finished_requests(make_engine):
    engine = make_engine(max_num_seqs=2, max_queue_wait=30)
    engine.door.admission.min_busy = 0.0
    client = Client(engine)
    assert engine.estimated_wait() == 0.0
    for prompt in random_prompts(4, 4, 8):
        client.submit(prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    engine.step()
    assert engine.estimated_wait() == float("inf")  # two running, two queued, nothing finished yet
    engine.run_until_idle()
    assert engine.door.admission.finished == pytest.approx(4, abs=0.1)
    assert engine.estimated_wait() == 0.0  # idle: a place is free
    assert 0 < engine.estimated_wait(3) < float("inf")  # one of three must wait for a finish


def test_the_engine_thread_serves_requests(make_engine):
    engine = make_engine()
    client = Client(engine)
    engine.start()
    rids = [client.submit(p) for p in random_prompts(3, 4, 12)]
    deadline = time.monotonic() + 60
    while not all(client.deltas[(r, 0)] and client.deltas[(r, 0)][-1].finish_reason for r in rids):
        assert time.monotonic() < deadline, "the engine thread did not finish the requests"
        time.sleep(0.01)
    engine.shutdown()
    assert [len(client.tokens(r)) for r in rids] == [GREEDY.max_tokens] * 3


def test_the_engine_thread_calls_resumed_when_work_arrives_at_it_idle(make_engine):
    """``pace_with``'s second hook runs once each time work arrives at an idle engine, before that
    step's ``before_step``, and not between the steps of work in progress."""
    engine = make_engine()
    calls = []
    engine.pace_with(lambda: calls.append("step"), lambda: calls.append("resumed"))
    client = Client(engine)
    engine.start()
    for prompt in random_prompts(2, 4, 12):
        rid = client.submit(prompt)
        deadline = time.monotonic() + 60
        while not (client.deltas[(rid, 0)] and client.deltas[(rid, 0)][-1].finish_reason):
            assert time.monotonic() < deadline, "the engine thread did not finish the request"
            time.sleep(0.01)
        time.sleep(0.05)  # the engine waits for work again
    engine.shutdown()
    assert calls.count("resumed") == 2 and calls[0] == "resumed" and calls[1] == "step"
    second = calls.index("resumed", 1)
    assert calls[second + 1] == "step" and calls.count("step") >= 2 * GREEDY.max_tokens


# ---- n and seeds ---------------------------------------------------------------------------

def test_n_choices_share_the_prompt(make_engine):
    prompt = random_prompts(1, 30, 31, seed=6)[0]
    single = alone(make_engine(), [prompt])[0]
    engine = make_engine()
    client = Client(engine)
    rid = client.submit(prompt, n=4)
    engine.run_until_idle()
    assert [client.tokens(rid, i) for i in range(4)] == [single] * 4
    cached = [client.final(rid, i).stats["cached_prompt_tokens"] for i in range(4)]
    assert cached == [0, 28, 28, 28]  # choice 0 computes the prompt; the rest reuse its 7 full blocks


def test_seeded_choices_are_reproducible(make_engine):
    prompt = random_prompts(1, 20, 21, seed=7)[0]
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=5, ignore_eos=True)
    runs = []
    for _ in range(2):
        engine = make_engine()
        client = Client(engine)
        rid = client.submit(prompt, params, n=3)
        engine.run_until_idle()
        runs.append([client.tokens(rid, i) for i in range(3)])
    assert runs[0] == runs[1]
    assert len({tuple(t) for t in runs[0]}) == 3, "each choice draws its own samples"
    # Choice i is seeded with seed + i: the same as a single request with that seed.
    shifted = SamplingParams(max_tokens=10, temperature=1.0, seed=6, ignore_eos=True)
    assert alone(make_engine(), [prompt], shifted)[0] == runs[0][1]


def test_a_seed_gives_the_same_tokens_alone_and_in_a_batch(make_engine, tiny):
    """A seeded sample is drawn with noise keyed by (seed, position), so the batch cannot change it,
    given logits that are the same bits in any batch: the dot8 format (fp32 GEMMs may round a row
    differently beside others, with the thread count, and a draw near a boundary would flip)."""
    if not kernels.available():
        pytest.skip("needs the project's dot8 kernel (w4a16): fp32 logits are not batch-invariant")
    model = build(TINY, dict(tiny.state_dict()), torch.float32, "cpu", "w4a16")
    prompt = random_prompts(1, 15, 16, seed=8)[0]
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, top_k=200, seed=1234, ignore_eos=True)
    solo = alone(make_engine(model), [prompt], params)[0]
    engine = make_engine(model, max_batched_tokens=24)
    client = Client(engine)
    others = [SamplingParams(max_tokens=15, temperature=1.0, ignore_eos=True),
              SamplingParams(max_tokens=25, temperature=0.7, seed=99, presence_penalty=1.0),
              SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=1.3, min_p=0.01, seed=3, logit_bias={42: 2.0})]
    for p, q in zip(random_prompts(4, 5, 40, seed=9), others):
        client.submit(p, q)
    engine.step()
    rid = client.submit(prompt, params)
    engine.run_until_idle()
    assert client.tokens(rid) == solo
    other_seed = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, top_k=200, seed=4321, ignore_eos=True)
    assert alone(make_engine(model), [prompt], other_seed)[0] != solo
