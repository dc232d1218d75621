"""Fit the routing policy to the hardware: measure each decoder once at start-up.

Which decoder is fastest for a single stream depends on the machine. On a GPU,
batch-1 decoding is memory-bound, so EAGLE's verified drafts and diffusion's
parallel unmasking beat plain AR. On a small CPU, where a forward over a few
tokens costs several times a one-token forward, plain AR can win. With
``--calibrate-router`` the server decodes one fixed chat prompt with every
decoder of its first model before it starts serving, and ``auto`` then sends:

- latency-bound work to the fastest decoder of all (lossy diffusion included);
- high-value work to the fastest lossless decoder (``ar`` or ``eagle``);
- batch work to ``ar`` (continuous batching).
"""

from __future__ import annotations

import dataclasses
import logging
import time

from .router import RoutingPolicy

PROMPT = "Write a short paragraph about why the sky is blue."
LOSSLESS = ("ar", "eagle")


def measure(engine, model: str, tokenizer, decoder: str, max_tokens: int) -> float:
    """Single-stream tokens/s of ``decoder`` on the calibration prompt (after one warm-up run)."""
    from dualserve.decoders.engine.sampling import SamplingParams

    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    speed = 0.0
    for tokens in (8, max_tokens):  # the first run warms up
        got: list[int] = []
        start = time.perf_counter()
        engine.submit(model, decoder, ids, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True),
                      lambda _i, delta: got.extend(delta.token_ids))
        engine.run_until_idle()
        speed = len(got) / max(time.perf_counter() - start, 1e-9)
    return speed


def calibrate(engine, model: str, tokenizer, policy: RoutingPolicy,
              max_tokens: int = 32) -> tuple[RoutingPolicy, dict[str, float]]:
    """The policy with ``interactive`` and ``high_value`` set from measured speeds, and the speeds."""
    speeds = {d: measure(engine, model, tokenizer, d, max_tokens) for d in engine.decoders_for(model)}
    fastest = max(speeds, key=speeds.get)
    lossless = [d for d in speeds if d in LOSSLESS]
    tuned = dataclasses.replace(policy, interactive=fastest,
                                high_value=max(lossless, key=speeds.get) if lossless else policy.high_value)
    logging.getLogger("dualserve").info(
        "router calibrated on %s: %s -> interactive=%s, high_value=%s", model,
        ", ".join(f"{d} {s:.1f} tok/s" for d, s in speeds.items()), tuned.interactive, tuned.high_value)
    return tuned, speeds


# What a step of each speculative decoder yields per target forward, as last measured on the bundled
# artifacts (README: the bundled EAGLE head and diffusion twin): EAGLE's mean acceptance length and the
# twin's tokens per forward at its default threshold. ``--calibrate-router`` measures instead of assuming.
PRIOR_TOKENS_PER_FORWARD = {"eagle": 1.55, "diffusion": 1.21}
# Tokens a forward of each computes: a draft tree, a block of 4 plus its anchor.
FORWARD_TOKENS = {"eagle": 8, "diffusion": 5}


def fit_to_forward_costs(policy: RoutingPolicy, table, fmt: str, decoders: list[str]) -> RoutingPolicy:
    """The policy with slower-than-``ar`` decoders taken out of ``interactive`` and ``high_value``
    (``eagle`` is never counted slower: its budget takes plain steps where drafts would not pay).

    ``table`` is the start-up format measurement (``models.formats.FormatTable``); a forward of n
    tokens is interpolated between its 1- and 8-token costs. A decoder's expected speed relative
    to ``ar`` is its tokens per forward over its forward's cost relative to a one-token forward.
    """
    one, eight = table.ms[fmt]["1"], table.ms[fmt]["8"]

    def relative(decoder: str) -> float:
        if decoder not in PRIOR_TOKENS_PER_FORWARD:
            return 1.0
        n = FORWARD_TOKENS[decoder]
        cost = (one + (eight - one) * (n - 1) / 7) / one
        speed = PRIOR_TOKENS_PER_FORWARD[decoder] / cost
        # EAGLE's cost budget drafts only where a draft is expected to pay on this host's measured
        # verify curve and takes a plain ``ar`` step elsewhere, and suffix lookup drafts for free:
        # it is not slower than ``ar`` where whole trees would be (docs/decoders.md, Routing).
        return max(speed, 1.0) if decoder == "eagle" else speed

    # Ties go to EAGLE: at worst a plain step, and an answer that repeats its context is drafted.
    order = sorted(decoders, key=lambda d: d != "eagle")
    speeds = {d: relative(d) for d in order}
    fastest = max(speeds, key=speeds.get)
    lossless = [d for d in speeds if d in LOSSLESS]
    tuned = dataclasses.replace(policy, interactive=fastest,
                                high_value=max(lossless, key=speeds.get) if lossless else policy.high_value)
    logging.getLogger("dualserve").info(
        "router fitted to forward costs (%s, 8 tokens cost %.1fx one): %s -> interactive=%s, high_value=%s",
        fmt, eight / one, ", ".join(f"{d} {s:.2f}x ar" for d, s in speeds.items()), tuned.interactive,
        tuned.high_value)
    return tuned
