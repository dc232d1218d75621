"""DiffusionGemma's canvas loop against transformers' ``DiffusionGemmaForBlockDiffusion.generate``.

* The sampler's rules, each alone, against the reference's own classes on random logits: the
  temperature schedule, the entropy (``Categorical``), entropy-bounded acceptance
  (``EntropyBoundSampler``) and stable-and-confident stopping.
* Token identity with ``generate`` at the same seed (torch's global RNG there, the request's
  generator here), both without the engine (``generate`` over a dense cache) and through the real
  engine (scheduler, shared block pool, paged keys/values, ``Request.commit``): short and long
  prompts (beyond the sliding window), early stopping, several canvases, a stop at EOS, chunked
  prompt encoding, two requests batched in the same forwards, and ``n = 2`` (choice i uses
  seed + i). ``generate`` appends whole canvases and pads after EOS; the engine's output is that,
  cut after the first EOS and at ``max_tokens``.
* Serving semantics: canvases streamed as they finish, stop strings and max_tokens trimmed by
  ``commit``, logprobs of committed tokens, NFE / steps per canvas, blocks returned to the pool,
  prefix-cache reuse, preemption, an infill suffix refused, registration through the deployment.
The tokenizer is a word-level ``tokenizers`` vocabulary over the 512 ids ("w3" ... "w511").
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import pytest
import torch
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

from dualserve.decoders.deployment import PoolSpec, build_deployment
from dualserve.decoders.diffusion.gemma import (Canvas, DiffusionGemmaDecoder, entropy_bounded_accept, generate,
                                                register_diffusion_gemma, schedule_temperature,
                                                stable_and_confident, token_entropy)
from dualserve.decoders.engine.engine import Engine, EngineConfig
from dualserve.decoders.engine.runner import ForwardItem, ModelRunner
from dualserve.decoders.engine.sampling import SamplingParams
from dualserve.models.diffusion_gemma import DenoisingConfig, load_diffusion_gemma
from dualserve.models.loader import LoadedModel
from dualserve.models.tokenizer import Tokenizer
from tiny_checkpoints import write_tiny_diffusion_gemma

VOCAB, CANVAS, EOS = 512, 8, 1
SHORT = [2, 10, 20, 30, 40]
LONG = list(range(2, 15))  # 13 tokens: beyond the sliding window of 8


def word_tokenizer() -> Tokenizer:
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    backend = Backend(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(["<pad>", "<eos>", "<bos>"])
    return Tokenizer(backend, bos_token_id=2, eos_token_id=EOS, pad_token_id=0)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_diffusion_gemma(tmp_path_factory.mktemp("diffusion_gemma"))


@pytest.fixture(scope="module")
def reference(tiny: Path):
    from transformers import DiffusionGemmaForBlockDiffusion

    return DiffusionGemmaForBlockDiffusion.from_pretrained(tiny).eval()


@pytest.fixture(scope="module")
def loaded(tiny: Path) -> LoadedModel:
    return load_diffusion_gemma(tiny, tokenizer=word_tokenizer())


def steps(n: int) -> DenoisingConfig:
    return DenoisingConfig(max_denoising_steps=n)


def hf_generate(reference, prompt: Sequence[int], max_tokens: int, num_steps: int,
                seed: int) -> tuple[list[int], float]:
    """transformers' tokens, cut after the first EOS and at max_tokens, and its tokens per forward."""
    torch.manual_seed(seed)
    out = reference.generate(torch.tensor([list(prompt)]), max_new_tokens=max_tokens, max_denoising_steps=num_steps)
    tokens = out.sequences[0, len(prompt):].tolist()
    if EOS in tokens:
        tokens = tokens[: tokens.index(EOS) + 1]
    return tokens[:max_tokens], float(out.tokens_per_forward[0])


# ---- the rules alone ---------------------------------------------------------------------------


def test_rules_match_the_reference_classes() -> None:
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
        EntropyBoundSampler, EntropyBoundSamplerConfig, LinearTemperatureScheduleLogitsProcessor,
        StableAndConfidentStoppingCriteria)

    cfg = DenoisingConfig(max_denoising_steps=7, t_min=0.3, t_max=0.9, entropy_bound=0.6)
    logits = torch.randn(1, CANVAS, VOCAB, generator=torch.Generator().manual_seed(0)) * 6
    processor = LinearTemperatureScheduleLogitsProcessor(0.3, 0.9, 7)
    for n in range(7, 0, -1):
        expected = processor(None, logits, cur_step=torch.tensor(n, dtype=torch.int32))
        assert torch.equal(logits / schedule_temperature(cfg, n), expected)
    assert torch.equal(token_entropy(logits), torch.distributions.Categorical(logits=logits).entropy())
    sampler = EntropyBoundSampler(EntropyBoundSamplerConfig(entropy_bound=0.6), CANVAS, VOCAB, 7)
    current, proposed = torch.zeros(1, CANVAS, dtype=torch.long), torch.ones(1, CANVAS, dtype=torch.long)
    sampler.accept_canvas(current, proposed, logits, 7)
    accepted = entropy_bounded_accept(token_entropy(logits), 0.6)
    assert torch.equal(accepted, sampler.accepted_token_mask) and 1 <= int(accepted.sum()) < CANVAS
    # Stopping: the first step can never stop (history is -1); two equal confident argmaxes do.
    confident = torch.zeros(1, CANVAS, VOCAB)
    confident[..., 3] = 40.0
    stopper = StableAndConfidentStoppingCriteria(stability_threshold=1, confidence_threshold=0.005)
    canvas = Canvas(tokens=current, argmax=current, remaining=7)
    for scores in (logits, confident, confident):
        argmax = scores.argmax(-1)
        assert stable_and_confident(canvas, argmax, token_entropy(scores), DenoisingConfig()) == bool(
            stopper(argmax, scores)[0])


# ---- token identity with transformers ----------------------------------------------------------


@pytest.mark.parametrize("prompt,max_tokens,num_steps,seed", [(SHORT, 8, 4, 0), (LONG, 24, 8, 3)])
def test_generate_without_engine_matches_transformers(reference, loaded, prompt, max_tokens, num_steps, seed) -> None:
    expected, _ = hf_generate(reference, prompt, max_tokens, num_steps, seed)
    got = generate(loaded.model, prompt, max_tokens, torch.Generator().manual_seed(seed), steps(num_steps),
                   eos_token_ids=[EOS])
    if EOS in got:
        got = got[: got.index(EOS) + 1]
    assert got[:max_tokens] == expected


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list = field(default_factory=list)
    deltas: list[list[int]] = field(default_factory=list)
    finish_reason: str | None = None
    stats: dict | None = None
    error: str | None = None


def make_engine(loaded: LoadedModel, num_steps: int, *, num_blocks: int = 64, block_size: int = 4,
                max_batched_tokens: int = 64, max_num_seqs: int = 16) -> Engine:
    engine = Engine(EngineConfig(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                                 max_batched_tokens=max_batched_tokens))
    runner = ModelRunner(loaded.model, num_blocks, block_size)
    register_diffusion_gemma(engine, "dg", runner, loaded, denoising=steps(num_steps))
    return engine


def run(engine: Engine, prompts: Sequence[Sequence[int]], params: SamplingParams, n: int = 1,
        suffix: Sequence[int] = ()) -> list[Outcome]:
    """Submit every prompt at once, drive the engine to idle; one Outcome per (prompt, choice)."""
    outcomes = [[Outcome() for _ in range(n)] for _ in prompts]

    def sink_for(i: int):
        def sink(index: int, delta) -> None:
            out = outcomes[i][index]
            out.tokens += delta.token_ids
            out.text += delta.text
            out.logprobs += delta.logprobs or []
            if delta.token_ids:
                out.deltas.append(delta.token_ids)
            if delta.finish_reason is not None:
                out.finish_reason, out.stats, out.error = delta.finish_reason, delta.stats, delta.error
        return sink

    for i, prompt in enumerate(prompts):
        engine.submit("dg", "diffusion", list(prompt), params, sink_for(i), n=n, suffix_ids=suffix)
    engine.run_until_idle()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks, "blocks were not returned to the pool"
    engine.pool.check()
    return [o for group in outcomes for o in group]


@pytest.mark.parametrize("prompt,max_tokens,num_steps,seed,budget", [
    (SHORT, 8, 4, 0, 64),     # one canvas, early stop after 4 steps at most
    (SHORT, 64, 16, 0, 64),   # stops at the EOS in the third canvas
    (LONG, 24, 8, 3, 5),      # beyond the sliding window; the prompt encoded in chunks of 5
])
def test_engine_matches_transformers(reference, loaded, prompt, max_tokens, num_steps, seed, budget) -> None:
    expected, tokens_per_forward = hf_generate(reference, prompt, max_tokens, num_steps, seed)
    [out] = run(make_engine(loaded, num_steps, max_batched_tokens=budget), [prompt],
                SamplingParams(max_tokens=max_tokens, seed=seed))
    assert out.tokens == expected
    assert out.finish_reason == ("stop" if expected[-1] == EOS else "length")
    assert all(len(d) <= CANVAS for d in out.deltas) and len(out.deltas) == -(-len(expected) // CANVAS)
    stats = out.stats
    assert stats["decoder"] == "diffusion" and len(stats["steps_per_block"]) == len(out.deltas)
    assert sum(stats["steps_per_block"]) == stats["forward_passes"]
    assert max(stats["steps_per_block"]) <= num_steps
    assert stats["tokens_per_forward"] == round(tokens_per_forward, 3)
    assert out.text == loaded.tokenizer.decode(expected, skip_special_tokens=True)


def test_batched_requests_and_n_choices_match_transformers(reference, loaded) -> None:
    short, _ = hf_generate(reference, SHORT, 24, 8, 3)
    short_next, _ = hf_generate(reference, SHORT, 24, 8, 4)
    long, _ = hf_generate(reference, LONG, 24, 8, 3)
    outs = run(make_engine(loaded, 8), [SHORT, LONG], SamplingParams(max_tokens=24, seed=3), n=2)
    assert [o.tokens for o in outs][:3] == [short, short_next, long]


def test_stop_string_max_tokens_and_logprobs(reference, loaded) -> None:
    expected, _ = hf_generate(reference, SHORT, 24, 8, 3)
    words = loaded.tokenizer.decode(expected, skip_special_tokens=True).split()
    stop = words[10]  # a word in the second canvas
    [out] = run(make_engine(loaded, 8), [SHORT], SamplingParams(max_tokens=24, seed=3, stop=(stop,), logprobs=2))
    assert out.finish_reason == "stop" and out.text == " ".join(words[:10]) + " "
    assert out.tokens == expected[:11] and len(out.logprobs) == 11
    for token, lp in zip(out.tokens, out.logprobs):  # the committed token is the final step's argmax
        assert lp.token_id == token and lp.top[0][0] == token and lp.logprob <= 0.0 and len(lp.top) == 2
    [cut] = run(make_engine(loaded, 8), [SHORT], SamplingParams(max_tokens=11, seed=3))
    assert cut.tokens == expected[:11] and cut.finish_reason == "length" and len(cut.deltas) == 2


def test_prefix_cache_reuse_and_preemption(reference, loaded) -> None:
    expected, _ = hf_generate(reference, LONG, 24, 8, 3)
    engine = make_engine(loaded, 8)
    params = SamplingParams(max_tokens=24, seed=3)
    first, again = run(engine, [LONG], params)[0], run(engine, [LONG], params)[0]
    assert first.tokens == again.tokens == expected
    assert first.stats["cached_prompt_tokens"] == 0 and again.stats["cached_prompt_tokens"] == 12
    # 9 blocks of 4 slots cannot hold three requests of 13 + 24 tokens at once: some are
    # preempted, recomputed later, and everyone still finishes with its blocks returned.
    tight = make_engine(loaded, 8, num_blocks=12, max_batched_tokens=64)
    outs = run(tight, [LONG, SHORT, [2, 7, 9]], params)
    assert all(len(o.tokens) == 24 or o.tokens[-1] == EOS for o in outs)
    assert tight.scheduler.num_preemptions > 0


def test_greedy_temperature_and_refusals(loaded) -> None:
    engine = make_engine(loaded, 6)
    greedy = SamplingParams(max_tokens=16, seed=5, temperature=0.0)
    a, b = run(engine, [SHORT], greedy)[0], run(engine, [SHORT], greedy)[0]
    assert a.tokens == b.tokens and (len(a.tokens) == 16 or a.tokens[-1] == EOS)
    hot = run(engine, [SHORT], SamplingParams(max_tokens=16, seed=5, temperature=1.5, top_k=5))[0]
    assert hot.finish_reason in ("stop", "length")
    [infill] = run(engine, [SHORT], SamplingParams(max_tokens=8, seed=0), suffix=[7, 8])
    assert infill.finish_reason == "error" and "infill" in infill.error and not infill.tokens


def test_temperature_zero_without_a_seed_is_the_same_every_time(loaded) -> None:
    """The canvas noise at temperature 0 comes from a fixed seed: the same text on every call, alone,
    beside other requests and for every choice; a seed still picks the noise at temperature 1."""
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    [alone] = run(make_engine(loaded, 8), [SHORT], greedy)
    [again] = run(make_engine(loaded, 8), [SHORT], greedy)
    assert again.tokens == alone.tokens and (len(alone.tokens) == 24 or alone.tokens[-1] == EOS)
    crowd = run(make_engine(loaded, 8), [LONG, SHORT, [2, 7, 9], SHORT], greedy, n=2)
    assert [o.tokens for o in crowd[2:4] + crowd[6:8]] == [alone.tokens] * 4
    hot = [run(make_engine(loaded, 8), [SHORT], SamplingParams(max_tokens=24, seed=s))[0].tokens for s in (1, 1, 2, 3)]
    assert hot[0] == hot[1] and len({tuple(t) for t in hot}) == 3


def test_batched_canvases_see_only_their_own_prefix(loaded) -> None:
    """Two canvases in one paged forward give what each gives alone (mixed self-conditioning)."""
    model = loaded.model
    runner = ModelRunner(model, num_blocks=8, block_size=4)
    tables, lens = [[0, 1], [2, 3, 4, 5]], [5, 13]
    canvases = [torch.arange(20, 28), torch.arange(40, 48)]

    def canvas(i: int) -> ForwardItem:  # a canvas is never stored: no slots
        return ForwardItem(canvases[i], torch.arange(lens[i], lens[i] + CANVAS), lens[i], tables[i], None,
                           mask="bidirectional")

    with torch.inference_mode():
        for table, n in zip(tables, lens):
            slots = torch.tensor([table[p // 4] * 4 + p % 4 for p in range(n)])
            runner.encode([ForwardItem(torch.arange(3, 3 + n), torch.arange(n), 0, table, slots)])
        sc = torch.randn(CANVAS, VOCAB, generator=torch.Generator().manual_seed(1)) * 5
        alone = [runner.denoise([canvas(0)]), runner.denoise([canvas(1)], sc)]
        both = runner.denoise([canvas(0), canvas(1)],
                              torch.cat([torch.zeros(CANVAS, VOCAB), sc]), torch.tensor([False] * 8 + [True] * 8))
    assert torch.allclose(both[:8], alone[0], atol=1e-4) and torch.allclose(both[8:], alone[1], atol=1e-4)


def test_runs_through_the_model_runner(loaded) -> None:
    """The decoder's KV is its runner's, one shape per layer; compiled steps are refused."""
    decoder = make_engine(loaded, 4).decoders[("dg", "diffusion")]
    assert isinstance(decoder, DiffusionGemmaDecoder)
    runner = decoder.kv_owner
    cfg = loaded.config
    assert isinstance(runner, ModelRunner) and runner.model is loaded.model
    assert [k.shape[2:] for k in runner.kv.k] == [torch.Size(s) for s in zip(cfg.kv_heads, cfg.head_dims)]
    with pytest.raises(TypeError):
        runner.compile()


def test_deployment_registers_the_decoder(reference, tiny: Path, tmp_path: Path) -> None:
    """A checkpoint directory with a tokenizer loads without one passed in, and serves through
    ``build_deployment`` (explicit block count: see the report on ``blocks_for``)."""
    expected, _ = hf_generate(reference, SHORT, 8, 48, 0)
    shutil.copytree(tiny, tmp_path, dirs_exist_ok=True)
    word_tokenizer().backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "bos_token": "<bos>"}))
    loaded = load_diffusion_gemma(tmp_path, name="dg")
    assert loaded.tokenizer.eos_token_ids == (EOS,)
    dep = build_deployment([loaded], EngineConfig(max_batched_tokens=64), PoolSpec(block_size=4, num_blocks=32))
    assert dep.decoders("dg") == ["diffusion"] and dep.runners["dg"].model is loaded.model
    outs: list[int] = []
    dep.engine.submit("dg", "diffusion", SHORT, SamplingParams(max_tokens=8, seed=0),
                      lambda i, d: outs.extend(d.token_ids))
    dep.engine.run_until_idle()
    assert outs == expected
