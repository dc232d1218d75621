"""The engine in-process: continuous batching, prefix cache, preemption, chunking, abort, n, seeds.

Most tests drive ``Engine.step`` / ``run_until_idle`` on a tiny random Llama-style model that
shares the default model's tokenizer (so stop strings and detokenization are real); the
``slow`` ones use the default model itself. The reference for "correct" is always the same
request run alone in an unconstrained engine: batching, chunking, preemption and prefix
sharing must not change a single token. After every test each engine it built must be idle
with every block back in its pool.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from typing import Iterator

import pytest
import torch

from dualserve.decoders.ar import ARDecoder
from dualserve.decoders.engine.engine import Engine, EngineConfig
from dualserve.decoders.engine.request import Delta, FailureKind
from dualserve.decoders.engine.runner import ModelRunner
from dualserve.decoders.engine.sampling import SamplingParams
from dualserve.decoders.engine.scheduler import QueueFull
from dualserve.models.attention import DenseAttention
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
    engine.admission.min_busy = 0.0
    client = Client(engine)
    assert engine.estimated_wait() == 0.0
    for prompt in random_prompts(4, 4, 8):
        client.submit(prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    engine.step()
    assert engine.estimated_wait() == float("inf")  # two running, two queued, nothing finished yet
    engine.run_until_idle()
    assert engine.admission.finished == pytest.approx(4, abs=0.1)
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


def test_a_seed_gives_the_same_tokens_alone_and_in_a_batch(make_engine):
    prompt = random_prompts(1, 15, 16, seed=8)[0]
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, top_k=200, seed=1234, ignore_eos=True)
    solo = alone(make_engine(), [prompt], params)[0]
    engine = make_engine(max_batched_tokens=24)
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
    assert alone(make_engine(), [prompt], other_seed)[0] != solo


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
