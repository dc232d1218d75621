"""The diffusion decoder against references written from the upstream samplers, on tiny checkpoints.

References (dense, no cache, one sequence, written here from the upstream code):
- ``llada_reference``: LLaDA ``generate.py`` (semi-AR blocks, low-confidence remasking, the
  linear schedule, optional classifier-free guidance), with the suffix as fixed right context;
- ``dream_reference``: Dream ``generation_utils.py`` ``_sample`` (shifted logits, the timestep
  schedule, maskgit_plus / topk_margin / entropy confidences);
- ``block_reference``: Fast-dLLM v2 ``generate`` (block-causal attention, shifted logits,
  sub-blocks under a threshold, the token after a finished block committed at once).
All run at temperature 0. One deviation from upstream, applied on both sides: the [MASK] id
is never proposed. The decoder runs through the real engine (scheduler, block pool, paged
attention, ragged batches) with a stand-in tokenizer.

Shared helpers here are imported by ``test_diffusion_engine.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Sequence

import pytest
import torch

from dualserve.decoders.engine.blocks import BlockPool, BlockTable
from dualserve.decoders.diffusion.decoder import DiffusionConfig, register_diffusion, work_item
from dualserve.decoders.diffusion.cache import CacheState, DualCache, ExactCache, Frame, NoCache, PrefixCache
from dualserve.decoders.diffusion.policies import DreamSchedule, Factor, LinearSchedule, LowConfidence, Threshold
from dualserve.decoders.engine.engine import Engine, EngineConfig
from dualserve.decoders.engine.runner import ModelRunner
from dualserve.decoders.engine.sampling import SamplingParams, TokenLogprob
from dualserve.models.attention import DenseAttention
from dualserve.models.families import read_config
from dualserve.models.loader import LoadedModel, build, load_hf_state
from dualserve.models.transformer import Transformer
from tiny_checkpoints import (DREAM_MASK_ID, FAST_DLLM_V2_MASK_ID, LLADA_MASK_ID, SDAR_MASK_ID,
                              write_tiny_block_diffusion, write_tiny_dream, write_tiny_llada)

SMALL_VOCAB, SMALL_MASK = 512, 500  # fast fixtures: the mask id is any valid row
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


# ---- fixtures and harness (shared with test_diffusion_engine.py) ------------------------------


class LetterTokenizer:
    """Each id decodes to two letters, so a stop string can begin inside a token."""

    vocab_size = SMALL_VOCAB

    def __init__(self, eos_token_ids: Sequence[int] = ()):
        self.eos_token_ids = list(eos_token_ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(97 + i % 26) + chr(97 + i // 26 % 26) for i in ids)


def load_tiny(path: Path) -> LoadedModel:
    """A tiny checkpoint through the shared loader (fp32), with the stand-in tokenizer."""
    config = read_config(json.loads((path / "config.json").read_text()))
    model = build(config, load_hf_state(path, config), torch.float32, "cpu")
    return LoadedModel(path.name, path, model.config, model, LetterTokenizer(), 0.0)


def write_tiny_twin(path: Path, block_size: int = 4) -> Path:
    """An AR Qwen2 checkpoint whose config.json carries the twin's ``dualserve_diffusion`` key."""
    write_tiny_dream(path, vocab_size=SMALL_VOCAB, mask_token_id=SMALL_MASK)
    config = json.loads((path / "config.json").read_text())
    for key in ("auto_map", "mask_token_id"):
        config.pop(key)
    config.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                  dualserve_diffusion={"block_size": block_size, "mask_token_id": SMALL_MASK, "shift_logits": True})
    (path / "config.json").write_text(json.dumps(config))
    return path


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    deltas: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    stats: dict | None = None
    error: str | None = None


def make_engine(loaded: LoadedModel, config: DiffusionConfig | None = None, *, num_blocks: int = 64,
                block_size: int = 16, max_batched_tokens: int = 512, prefix_caching: bool = True,
                publish: bool = True, tokenizer: LetterTokenizer | None = None) -> Engine:
    engine = Engine(EngineConfig(num_blocks=num_blocks, block_size=block_size, max_batched_tokens=max_batched_tokens,
                                 enable_prefix_caching=prefix_caching))
    runner = ModelRunner(loaded.model, num_blocks, block_size)
    model = replace(loaded, tokenizer=tokenizer) if tokenizer else loaded
    register_diffusion(engine, "m", runner, model, config, publish_blocks=publish)
    return engine


def run(engine: Engine, prompts: Sequence[Sequence[int]], params: SamplingParams = GREEDY,
        suffixes: Sequence[Sequence[int]] | None = None, n: int = 1) -> list[Outcome]:
    """Submit all prompts at once, drive the engine to idle; one Outcome per (prompt, choice)."""
    outcomes = [[Outcome() for _ in range(n)] for _ in prompts]

    def sink_for(i: int):
        def sink(index: int, delta) -> None:
            out = outcomes[i][index]
            out.tokens += delta.token_ids
            out.text += delta.text
            out.logprobs += delta.logprobs or []
            out.deltas += 1
            if delta.finish_reason is not None:
                out.finish_reason, out.stats, out.error = delta.finish_reason, delta.stats, delta.error
        return sink

    for i, prompt in enumerate(prompts):
        engine.submit("m", "diffusion", list(prompt), params, sink_for(i), n=n,
                      suffix_ids=suffixes[i] if suffixes else ())
    engine.run_until_idle()
    pool = engine.pool
    assert pool.num_free_blocks == pool.num_blocks, "blocks were not returned to the pool"
    pool.check()
    return [o for group in outcomes for o in group]


def decode(loaded: LoadedModel, prompts: Sequence[Sequence[int]], config: DiffusionConfig | None = None,
           params: SamplingParams = GREEDY, **engine_kw) -> list[list[int]]:
    return [o.tokens for o in run(make_engine(loaded, config, **engine_kw), prompts, params)]


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, SMALL_MASK, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llada(tmp_path_factory) -> LoadedModel:
    return load_tiny(write_tiny_llada(tmp_path_factory.mktemp("llada"), vocab_size=SMALL_VOCAB,
                                      mask_token_id=SMALL_MASK))


@pytest.fixture(scope="module")
def sharp_llada(tmp_path_factory) -> LoadedModel:
    """LLaDA with its output head scaled up: peaked logits, so thresholds pass several tokens."""
    loaded = load_tiny(write_tiny_llada(tmp_path_factory.mktemp("sharp"), vocab_size=SMALL_VOCAB,
                                        mask_token_id=SMALL_MASK))
    with torch.no_grad():
        loaded.model.lm_head.weight.mul_(8.0)
    return loaded


@pytest.fixture(scope="module")
def dream(tmp_path_factory) -> LoadedModel:
    return load_tiny(write_tiny_dream(tmp_path_factory.mktemp("dream"), vocab_size=SMALL_VOCAB,
                                      mask_token_id=SMALL_MASK))


@pytest.fixture(scope="module")
def twin(tmp_path_factory) -> LoadedModel:
    return load_tiny(write_tiny_twin(tmp_path_factory.mktemp("twin")))


# ---- dense references ------------------------------------------------------------------


@torch.no_grad()
def dense_logits(model: Transformer, ids: torch.Tensor, mode: str = "bidirectional",
                 block_size: int | None = None) -> torch.Tensor:
    attn = DenseAttention([len(ids)], mode=mode, block_size=block_size)
    hidden, _ = model(ids, torch.arange(len(ids)), attn)
    return model.logits(hidden)  # (len, vocab)


def llada_reference(model: Transformer, prompt_ids: list[int], gen_length: int, block_length: int, steps: int,
                    mask_id: int, cfg_scale: float = 0.0, suffix: Sequence[int] = ()) -> list[int]:
    """LLaDA ``generate`` (temperature 0, low_confidence), one sequence, suffix kept fixed."""
    x = torch.tensor(prompt_ids + [mask_id] * gen_length + list(suffix))
    p = len(prompt_ids)
    fixed = x != mask_id
    num_blocks = gen_length // block_length
    steps_per_block = steps // num_blocks
    for b in range(num_blocks):
        lo, hi = p + b * block_length, p + (b + 1) * block_length
        m = int((x[lo:hi] == mask_id).sum())
        base, rem = divmod(m, steps_per_block)
        counts = [base + 1] * rem + [base] * (steps_per_block - rem)  # get_num_transfer_tokens
        for i in range(steps_per_block):
            mask_index = x == mask_id
            logits = dense_logits(model, x)
            if cfg_scale > 0:
                un_x = x.clone()
                un_x[fixed] = mask_id
                uncond = dense_logits(model, un_x)
                logits = uncond + (cfg_scale + 1) * (logits - uncond)
            logits[:, mask_id] = float("-inf")
            x0 = logits.argmax(-1)
            x0_p = torch.softmax(logits, -1).gather(-1, x0[:, None])[:, 0]
            x0_p[hi:] = float("-inf")
            x0 = torch.where(mask_index, x0, x)
            conf = torch.where(mask_index, x0_p, torch.tensor(float("-inf")))
            idx = torch.topk(conf, counts[i]).indices
            x[idx] = x0[idx]
    return x[p: p + gen_length].tolist()


def fast_dllm_reference(model: Transformer, prompt_ids: list[int], gen_length: int, block_length: int,
                        mask_id: int, threshold: float | None = None, factor: float | None = None) -> list[int]:
    """Fast-dLLM v1 ``generate`` without cache (temperature 0): per block, until it has no masks,
    the threshold rule (``get_transfer_index``) or the factor rule (``get_transfer_index_dynamic``)."""
    x = torch.tensor(prompt_ids + [mask_id] * gen_length)
    p = len(prompt_ids)
    for lo in range(p, p + gen_length, block_length):
        hi = lo + block_length
        while bool((x[lo:hi] == mask_id).any()):
            mask_index = x == mask_id
            mask_index[hi:] = False
            logits = dense_logits(model, x)
            logits[:, mask_id] = float("-inf")
            x0 = logits.argmax(-1)
            conf = torch.softmax(logits, -1).gather(-1, x0[:, None])[:, 0]
            conf = torch.where(mask_index, conf, torch.tensor(float("-inf")))
            m = int(mask_index.sum())
            order = torch.topk(conf, m).indices
            if threshold is not None:
                take = [order[0]] + [i for i in order[1:] if conf[i] >= threshold]
            else:
                c = conf[order].tolist()
                top_i = m - 1
                for n in range(m):
                    if c[n] < (-1 if n == 0 else 1 - factor / (n + 2)):
                        top_i = n
                        break
                take = order[: top_i + 1 if top_i in (0, m - 1) else top_i]
            idx = torch.tensor([int(i) for i in take])
            x[idx] = x0[idx]
    return x[p:].tolist()


def dream_reference(model: Transformer, prompt_ids: list[int], gen_length: int, steps: int, mask_id: int,
                    alg: str, eps: float = 1e-3) -> list[int]:
    """Dream ``_sample`` (temperature 0) for algs maskgit_plus / topk_margin / entropy, one sequence."""
    x = torch.tensor(prompt_ids + [mask_id] * gen_length)
    timesteps = torch.linspace(1, eps, steps + 1)
    for i in range(steps):
        mask_index = x == mask_id
        logits = dense_logits(model, x)
        logits = torch.cat([logits[:1], logits[:-1]])  # position p is predicted by row p - 1
        logits[:, mask_id] = float("-inf")
        probs = torch.softmax(logits[mask_index], -1)
        conf, x0 = probs.max(-1)
        if alg == "topk_margin":
            top = probs.sort(-1, descending=True).values
            conf = top[:, 0] - top[:, 1]
        elif alg == "entropy":
            conf = (probs * torch.log(probs + 1e-10)).sum(-1)
        t, s = timesteps[i], timesteps[i + 1]
        num_mask = mask_index.sum() / 1
        k = int(num_mask * (1 - s / t)) if i < steps - 1 else int(num_mask)
        full_conf = torch.full(x.shape, float("-inf"))
        full_conf[mask_index] = conf
        if k > 0:
            idx = torch.topk(full_conf, k).indices
            x_ = torch.full(x.shape, mask_id)
            x_[mask_index] = x0
            x[idx] = x_[idx]
    return x[len(prompt_ids):].tolist()


def block_reference(model: Transformer, prompt_ids: list[int], gen_length: int, block: int, small: int,
                    tau: float, mask_id: int) -> list[int]:
    """Fast-dLLM v2 ``generate`` (temperature 0, no cache): block-causal, shifted, sub-blocks, threshold."""
    x = torch.tensor(prompt_ids + [mask_id] * gen_length)
    p, end = len(prompt_ids), len(prompt_ids) + gen_length
    for b0 in range(p // block * block, end, block):
        for s0 in range(b0, b0 + block, small):
            lo, hi = max(s0, p), min(s0 + small, end)
            while lo < hi and bool((x[lo:hi] == mask_id).any()):
                logits = dense_logits(model, x[: min(b0 + block, end)], "block_causal", block)
                masked = lo + torch.nonzero(x[lo:hi] == mask_id)[:, 0]
                rows = logits[masked - 1]
                rows[:, mask_id] = float("-inf")
                conf, x0 = torch.softmax(rows, -1).max(-1)
                take = conf >= tau
                take[conf.argmax()] = True
                if int(masked[0]) % block == 0:  # the AR token after a finished block
                    take[0] = True
                x[masked[take]] = x0[take]
    return x[p:].tolist()


# ---- families ----------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llada", "dream", "fast_dllm_v2", "sdar"])
def test_real_layout_checkpoints_load_and_decode(family: str, tmp_path: Path) -> None:
    writers = {"llada": (write_tiny_llada, LLADA_MASK_ID, False, None),
               "dream": (write_tiny_dream, DREAM_MASK_ID, True, None),
               "fast_dllm_v2": (write_tiny_block_diffusion, FAST_DLLM_V2_MASK_ID, True, 8),
               "sdar": (partial(write_tiny_block_diffusion, flavor="sdar"), SDAR_MASK_ID, False, 4)}
    writer, mask_id, shift, block = writers[family]
    loaded = load_tiny(writer(tmp_path))
    cfg = loaded.config
    assert (cfg.mask_token_id, cfg.shift_logits, cfg.diffusion_block_size) == (mask_id, shift, block)
    assert cfg.is_diffusion and cfg.qk_norm == (family == "sdar")
    out = run(make_engine(loaded), [[11, 12, 13, 14, 15]], SamplingParams(max_tokens=6, temperature=0.0))[0]
    assert out.finish_reason == "length" and len(out.tokens) == 6 and mask_id not in out.tokens
    assert out.stats["decoder"] == "diffusion" and out.stats["forward_passes"] >= 1


def test_twin_config(twin: LoadedModel) -> None:
    cfg = twin.config
    assert (cfg.family, cfg.mask_token_id, cfg.diffusion_block_size, cfg.shift_logits) == (
        "block_diffusion", SMALL_MASK, 4, True)


# ---- reference equivalences --------------------------------------------------------------


@pytest.mark.parametrize("block_length,steps", [(8, 16), (8, 8), (16, 4)])
def test_llada_low_confidence_matches_reference(llada: LoadedModel, block_length: int, steps: int) -> None:
    """LLaDA's sampler: steps over the whole answer, blocks of ``block_length``, counts per step."""
    gen = 16
    config = DiffusionConfig(block_length=block_length, policy=LowConfidence(),
                             schedule=LinearSchedule(steps // (gen // block_length)), cache=NoCache())
    p = prompt(5)
    out = run(make_engine(llada, config), [p], replace(GREEDY, max_tokens=gen))[0]
    assert out.tokens == llada_reference(llada.model, p, gen, block_length, steps, SMALL_MASK)
    assert out.stats["forward_passes"] == min(steps, gen)


def test_llada_threshold_above_one_is_low_confidence_one_token_per_step(llada: LoadedModel) -> None:
    config = DiffusionConfig(block_length=8, policy=Threshold(1.01), cache=NoCache())
    p = prompt(6, seed=1)
    out = run(make_engine(llada, config), [p], GREEDY)[0]
    assert out.tokens == llada_reference(llada.model, p, 16, 8, 16, SMALL_MASK)
    assert out.stats["forward_passes"] == 16 and out.stats["steps_per_block"] == [8, 8]


def test_llada_classifier_free_guidance_matches_reference(llada: LoadedModel) -> None:
    config = DiffusionConfig(block_length=8, policy=LowConfidence(), schedule=LinearSchedule(4), cache=NoCache(),
                             cfg_scale=1.5)
    p = prompt(5, seed=2)
    out = run(make_engine(llada, config), [p], GREEDY)[0]
    assert out.tokens == llada_reference(llada.model, p, 16, 8, 8, SMALL_MASK, cfg_scale=1.5)
    assert out.tokens != llada_reference(llada.model, p, 16, 8, 8, SMALL_MASK)


@pytest.mark.parametrize("policy", [Threshold(0.5), Factor(1.0)], ids=["threshold", "factor"])
def test_fast_dllm_parallel_rules_match_reference(sharp_llada: LoadedModel, policy) -> None:
    """Several tokens per forward on a model with peaked logits."""
    config = DiffusionConfig(block_length=8, policy=policy, cache=NoCache())
    p = prompt(7, seed=15)
    out = run(make_engine(sharp_llada, config), [p], replace(GREEDY, max_tokens=24))[0]
    kw = {"threshold": policy.tau} if isinstance(policy, Threshold) else {"factor": policy.factor}
    assert out.tokens == fast_dllm_reference(sharp_llada.model, p, 24, 8, SMALL_MASK, **kw)
    assert out.stats["tokens_per_forward"] > 1.2


@pytest.mark.parametrize("alg,kind", [("maskgit_plus", "prob"), ("topk_margin", "margin"),
                                      ("entropy", "neg_entropy")])
def test_dream_matches_reference(dream: LoadedModel, alg: str, kind: str) -> None:
    gen, steps = 12, 8
    config = DiffusionConfig(block_length=None, policy=LowConfidence(), schedule=DreamSchedule(steps),
                             cache=NoCache(), confidence=kind)
    p = prompt(5, seed=3)
    out = run(make_engine(dream, config), [p], replace(GREEDY, max_tokens=gen))[0]
    assert out.tokens == dream_reference(dream.model, p, gen, steps, SMALL_MASK, alg)


@pytest.mark.parametrize("prompt_len", [8, 6])
@pytest.mark.parametrize("cache", [NoCache(), ExactCache(), DualCache(refresh_every=1)], ids=["none", "exact", "dual"])
def test_block_diffusion_matches_reference(twin: LoadedModel, prompt_len: int, cache) -> None:
    """Sub-blocks of 2 inside attention blocks of 4; a prompt ending on and off a block boundary."""
    config = DiffusionConfig(block_length=2, policy=Threshold(0.3), cache=cache)
    p = prompt(prompt_len, seed=4)
    out = run(make_engine(twin, config), [p], replace(GREEDY, max_tokens=14))[0]
    assert out.tokens == block_reference(twin.model, p, 14, 4, 2, 0.3, SMALL_MASK)


# ---- cache strategies ---------------------------------------------------------------------


@pytest.mark.parametrize("cache", [PrefixCache(refresh_every=1), DualCache(refresh_every=1)], ids=["prefix", "dual"])
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_caches_refreshed_every_step_equal_no_cache(request, family: str, cache) -> None:
    loaded = request.getfixturevalue(family)
    base = DiffusionConfig(block_length=8, policy=LowConfidence(), schedule=LinearSchedule(4), cache=NoCache())
    prompts = [prompt(5, seed=5), prompt(9, seed=6)]
    assert decode(loaded, prompts, replace(base, cache=cache)) == decode(loaded, prompts, base)


@pytest.mark.parametrize("strategy", [PrefixCache(), DualCache()], ids=["prefix", "dual"])
@pytest.mark.parametrize("family", ["llada", "dream", "twin"])
def test_fresh_cached_forward_equals_full_forward(request, family: str, strategy) -> None:
    """Right after a refresh, the cached spans see exactly what a full forward sees."""
    loaded = request.getfixturevalue(family)
    cfg = loaded.config
    block = cfg.diffusion_block_size
    shift = int(cfg.shift_logits)
    tokens = torch.tensor(prompt(6, seed=7) + [SMALL_MASK] * 14)  # canvas starts at 6
    if block:  # a sub-block inside the attention block [8, 12), with stale keys on both sides
        frame = Frame((9, 11), horizon=12, exact_start=8, first_row=9 - shift)
    else:
        frame = Frame((8, 12), horizon=len(tokens), exact_start=0, first_row=8 - shift)
    pool = BlockPool(8, 4)
    table = BlockTable()
    pool.allocate(table, tokens.tolist(), len(tokens))
    runner = ModelRunner(loaded.model, 8, 4)
    state = CacheState()
    refresh = strategy.work(frame, state, 0)
    assert refresh.refresh and refresh.query == (0, frame.horizon)
    full, _ = runner.forward([work_item(refresh, tokens, table, pool, block)])
    state.since_refresh, state.refreshed_unit = 1, 0
    cached = strategy.work(frame, state, 0)
    assert not cached.refresh and cached.query[0] == frame.first_row
    part, _ = runner.forward([work_item(cached, tokens, table, pool, block)])
    a, b = cached.query
    torch.testing.assert_close(part, full[a:b], atol=1e-5, rtol=1e-5)


def test_published_blocks_are_exact(twin: LoadedModel) -> None:
    """With publishing on, a later request reuses finished blocks and decodes the same tokens."""
    shared = prompt(20, seed=8)
    first, second = shared + prompt(3, seed=9), shared[:16] + prompt(7, seed=10)
    engine = make_engine(twin)
    run(engine, [first])
    again = run(engine, [second])[0]
    assert again.stats["cached_prompt_tokens"] == 16
    assert again.tokens == decode(twin, [second], prefix_caching=False)[0]
    # n > 1: the other choices join once the first has published its prompt blocks.
    choices = run(make_engine(twin), [shared], replace(GREEDY, max_tokens=8), n=3)
    assert [c.stats["cached_prompt_tokens"] for c in choices] == [0, 16, 16]
    assert len({tuple(c.tokens) for c in choices}) == 1


def test_long_prompt_prefill_is_chunked(twin: LoadedModel) -> None:
    p = prompt(41, seed=11)
    small = run(make_engine(twin, max_batched_tokens=12), [p])[0]
    assert small.tokens == decode(twin, [p])[0]
    assert small.stats["forward_passes"] > run(make_engine(twin), [p])[0].stats["forward_passes"]


# ---- batching ------------------------------------------------------------------------------


@pytest.mark.parametrize("cache", [PrefixCache(), DualCache(), ExactCache()], ids=["prefix", "dual", "exact"])
@pytest.mark.parametrize("family", ["llada", "dream", "twin"])
def test_batch_never_changes_greedy_output(request, family: str, cache) -> None:
    """Prompts of different lengths share every forward (ragged, no padding); each gets its own tokens."""
    loaded = request.getfixturevalue(family)
    prompts = [prompt(3, seed=12), prompt(7, seed=13), prompt(12, seed=14)]
    # The twin's units are sub-blocks of 2 in attention blocks of 4 (Fast-dLLM v2's sub-block cache).
    config = DiffusionConfig(block_length=2 if family == "twin" else 4, policy=Threshold(0.2), cache=cache)
    together = decode(loaded, prompts, config)
    alone = [decode(loaded, [p], config)[0] for p in prompts]
    assert together == alone
    assert len({tuple(t) for t in together}) == 3
