"""Keyed sampling: a seeded sample is a function of (distribution, seed, output position) alone.

- ``keyed_uniform``: deterministic, in [0, 1), spread evenly, different per seed and position;
- the acceptance rule on tensors (``tree.accept_sampled``): for fixed keyed uniforms, the accepted
  path plus the bonus token is exactly the sequence of plain samples, whatever the tree;
- the decoders on tiny models: sampled ``eagle`` gives sampled ``ar``'s tokens for the same seed
  (drafts accepted on purpose), alone or batched, with every tree shape and source;
- devices: every random draw on these paths is made on the device of the tensor it draws for
  (a CPU generator never meets CUDA probabilities), and ``ar`` / ``eagle`` draw from no generator.
"""

from __future__ import annotations

import random

import pytest
import torch

from dualserve.decoders.diffusion.gemma import draw
from dualserve.decoders.diffusion.policies import confidence, propose
from dualserve.decoders.eagle.tree import DraftTree, TreeConfig, accept_sampled
from dualserve.decoders.engine import sampling
from dualserve.decoders.engine.sampling import SamplingParams, inverse_cdf, keyed_uniform
from test_eagle import make_engine, oracle_head, run, tiny_target, tokens

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 6


# ---- the keyed uniform ------------------------------------------------------------------

def test_keyed_uniform_is_a_function_of_seed_and_position() -> None:
    us = [keyed_uniform(1234, t) for t in range(4096)]
    assert us == [keyed_uniform(1234, t) for t in range(4096)]
    assert all(0.0 <= u < 1.0 and (u * 2**24).is_integer() for u in us)  # 24 bits: exact in float32
    assert len(set(us)) > 4000
    # Neighbouring seeds (choice i of n uses seed + i) are not shifts of one another.
    assert all(keyed_uniform(1235, t) != keyed_uniform(1234, t + k) for t in range(64) for k in (-1, 1))
    assert keyed_uniform(-1, 0) == keyed_uniform(2**64 - 1, 0)  # negative seeds map onto 64 bits
    counts = torch.histc(torch.tensor(us), bins=16, min=0.0, max=1.0)
    expected = len(us) / 16
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 15 + 5 * 30 ** 0.5  # 15 degrees of freedom


# ---- the acceptance rule on tensors -----------------------------------------------------

def target_probs(prefix: tuple[int, ...]) -> torch.Tensor:
    """A fixed, peaked distribution for each prefix (a stand-in target), (VOCAB,)."""
    gen = torch.Generator().manual_seed(hash(prefix) % 2**31)
    return torch.softmax(3 * torch.randn(VOCAB, generator=gen), -1)


def plain_samples(uniforms: list[float]) -> list[int]:
    """What plain AR sampling emits with these uniforms, one position at a time."""
    out: list[int] = []
    for u in uniforms:
        out.append(inverse_cdf(target_probs(tuple(out)), u))
    return out


def random_tree(rng: random.Random, truth: list[int], follow: int, width: int, depth: int) -> DraftTree:
    """A random tree that holds ``truth``'s first ``follow`` tokens as one path, beside other drafts."""
    tokens, parents, depths = [-1], [-1], [0]

    def add(token: int, parent: int) -> int:
        tokens.append(token)
        parents.append(parent)
        depths.append(depths[parent] + 1)
        return len(tokens) - 1

    for _ in range(rng.randrange(0, 12)):  # random drafts anywhere
        parent = rng.randrange(len(tokens))
        if depths[parent] < depth:
            add(rng.randrange(VOCAB), parent)
    node = 0
    for d in range(follow):  # the true path, with siblings that are wrong
        for _ in range(rng.randrange(width)):
            add((truth[d] + rng.randrange(1, VOCAB)) % VOCAB, node)
        node = add(truth[d], node)
    # Parents before children: order the nodes by depth (stable), remapping parents.
    order = sorted(range(len(tokens)), key=lambda i: depths[i])
    where = {old: new for new, old in enumerate(order)}
    return DraftTree([tokens[i] for i in order], [where[parents[i]] if parents[i] >= 0 else -1 for i in order])


def node_prefix(tree: DraftTree, node: int) -> tuple[int, ...]:
    out = []
    while node > 0:
        out.append(tree.tokens[node])
        node = tree.parents[node]
    return tuple(reversed(out))


@pytest.mark.parametrize("trial", range(40))
def test_accepted_path_and_bonus_are_the_plain_samples_whatever_the_tree(trial: int) -> None:
    rng = random.Random(trial)
    depth = rng.randrange(1, 6)
    uniforms = [keyed_uniform(trial, t) for t in range(depth + 1)]
    truth = plain_samples(uniforms)
    tree = random_tree(rng, truth, follow=rng.randrange(depth + 1), width=3, depth=depth)

    def probs_at(node: int, accepted: list[int]) -> torch.Tensor:
        assert list(node_prefix(tree, node)) == accepted  # the walk only asks along accepted paths
        return target_probs(tuple(accepted))

    path, bonus = accept_sampled(tree, probs_at, uniforms)
    emitted = [tree.tokens[n] for n in path] + [bonus]
    assert emitted == truth[: len(emitted)]
    # The walk stops only where no child holds the sample (or the tree ends).
    children = tree.children()
    last = path[-1] if path else 0
    assert all(tree.tokens[c] != bonus for c in children[last])


def test_a_root_alone_emits_the_plain_sample() -> None:
    uniforms = [keyed_uniform(7, 0)]
    assert accept_sampled(DraftTree([2], [-1]), lambda n, acc: target_probs(()), uniforms) == \
        ([], plain_samples(uniforms)[0])


# ---- the decoders on tiny models --------------------------------------------------------

SAMPLED = SamplingParams(max_tokens=20, temperature=0.6, top_k=40, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]


def seeded(seed: int, **kw) -> SamplingParams:
    return SamplingParams(**{**SAMPLED.__dict__, "seed": seed, **kw})


@pytest.mark.parametrize("tree", [TreeConfig(3, 2, 4), TreeConfig.chain(4), TreeConfig(2, 3, 6)])
def test_sampled_eagle_is_sampled_ar_token_for_token(tree: TreeConfig) -> None:
    """The head drafts well (a near-oracle on a near-bigram target), so drafts are accepted; every
    seeded eagle request emits ar's tokens, batched with the others and with unseeded neighbours."""
    target = tiny_target(4, 0.1)
    engine = make_engine(target, oracle_head(target, noise=0.02), tree)
    jobs = [(d, p, seeded(100 + i)) for i, p in enumerate(PROMPTS) for d in ("ar", "eagle")]
    jobs += [("eagle", p, SAMPLED) for p in PROMPTS]  # unseeded neighbours
    outs = run(engine, jobs)
    for i in range(0, 2 * len(PROMPTS), 2):
        assert tokens(outs[i + 1]) == tokens(outs[i])
    stats = [o[-1].stats for o in outs[1: 2 * len(PROMPTS): 2]]
    assert sum(s["mean_accept_length"] for s in stats) / len(stats) > 1.5  # drafts were accepted
    # Alone, a seeded request gives what it gave in the batch.
    alone = run(make_engine(target, oracle_head(target, noise=0.02), tree), [("eagle", PROMPTS[0], seeded(100))])
    assert tokens(alone[0]) == tokens(outs[1])


def test_suffix_drafts_keep_ar_samples_and_seeds_differ() -> None:
    """Suffix lookup alone (no head) on a prompt that repeats; seed + 1 (the next choice) differs."""
    target = tiny_target(4, 0.1)
    engine = make_engine(target)  # no head: eagle drafts from suffix lookup
    prompt = [7, 8, 9, 10, 11] * 4
    jobs = [(d, prompt, seeded(5, top_k=3)) for d in ("ar", "eagle")]
    outs = run(engine, jobs)
    assert tokens(outs[1]) == tokens(outs[0])
    assert outs[1][-1].stats["suffix_accept_length"] > 1  # the output repeats itself: suffix drafts hold
    # Different seeds (choice i of n uses seed + i) give different streams.
    other = run(engine, [("ar", prompt, seeded(6, top_k=3))])
    assert tokens(other[0]) != tokens(outs[0])


# ---- devices ----------------------------------------------------------------------------

DRAWS = ("rand", "randint", "randn", "multinomial", "bernoulli", "normal")


def test_every_draw_is_on_its_generators_device_and_eagle_draws_from_none(monkeypatch) -> None:
    """Wraps torch's random ops and ``searchsorted``: a generator's device must be the device of the
    tensor drawn from or made; the probabilities and the draw must share a device. Sampled ``ar``
    and ``eagle`` use the keyed uniforms, so they call no generator at all (on CUDA a CPU generator
    with CUDA probabilities raises)."""
    used: list[str] = []

    def wrap(name: str):
        op = getattr(torch, name)

        def checked(*args, generator: torch.Generator | None = None, **kw):
            out = op(*args, generator=generator, **kw)
            if generator is not None:
                used.append(name)
                tensors = [a for a in args if isinstance(a, torch.Tensor)]
                device = torch.device(kw["device"]) if "device" in kw else (tensors[0] if tensors else out).device
                assert generator.device == device, (name, generator.device, device)
            return out
        return checked

    for name in DRAWS:
        monkeypatch.setattr(torch, name, wrap(name))
    search = torch.searchsorted

    def searchsorted(sorted_seq, values, **kw):
        assert sorted_seq.device == values.device
        return search(sorted_seq, values, **kw)
    monkeypatch.setattr(torch, "searchsorted", searchsorted)
    keyed: list[tuple[int, int]] = []
    real_keyed = sampling.keyed_uniform

    def counted(seed: int, position: int) -> float:
        keyed.append((seed, position))
        return real_keyed(seed, position)
    for module in ("dualserve.decoders.ar", "dualserve.decoders.eagle.decoder"):
        monkeypatch.setattr(f"{module}.keyed_uniform", counted)

    target = tiny_target(4, 0.1)
    engine = make_engine(target, oracle_head(target, noise=0.02), TreeConfig(3, 2, 4))
    outs = run(engine, [(d, PROMPTS[0], seeded(9)) for d in ("ar", "eagle")] + [("eagle", PROMPTS[1], SAMPLED)])
    assert tokens(outs[1]) == tokens(outs[0])
    assert not used  # no generator drawn from on the sampled ar / eagle paths
    assert {p for s, p in keyed if s == 9} >= set(range(SAMPLED.max_tokens))
    # Noise that is not one token per position (diffusion canvases) does use the request's
    # generator: each draw checked above.
    gen, logits = torch.Generator().manual_seed(0), torch.randn(1, 8, VOCAB)
    draw(logits, SAMPLED, gen)
    propose(logits[0], SAMPLED, gen)
    confidence("random", torch.softmax(logits[0], -1), logits[0].argmax(-1), gen)
    assert used == ["multinomial", "rand", "rand"]
