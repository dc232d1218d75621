"""How much to draft each step: the verify cost of this host against what the drafts earn.

A speculative step over a tree of n drafted nodes costs one target forward over 1 + n
tokens (plus the head's drafting), and earns 1 + E tokens, E the expected accepted
length. A plain ``ar`` step costs a forward over 1 token and earns 1. On a small CPU a
forward over 8 tokens costs about twice one over a single token; on a GPU at batch 1 it
costs the same; at a large batch every extra token costs its share of a GEMM-bound
forward. So the right draft size depends on the host, the batch and how well the sources
are doing, and no fixed tree is right everywhere (the same argument as EAGLE-2's dynamic
trees, section 4, and the "goodput" budgets of Liu et al., "Optimizing Speculative
Decoding for Serving", 2024).

Inputs, each measured:

* ``CostCurve``: seconds of a verify forward by token count, a prior (the start-up format
  measurement's 1- and 8-token costs, ``models/formats.py``, or a default shape) corrected
  by the forwards the decoder times as it runs;
* ``SourceRate``: per draft source (the EAGLE head, suffix lookup), the request's running
  per-level acceptance rate, an EMA; a source left unused drifts back towards its prior,
  so a source that failed once is tried again later;
* the batch: the tokens the rest of the batch puts in the same forward and the tokens it
  emits (from the previous step).

``choose_budget`` is pure: it scores every (head depth, suffix depth) pair by expected
tokens per second of the whole step and returns the best; depth 0 for both is a plain
``ar`` step, which it picks whenever drafting cannot pay.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

Source = str  # "head" (EAGLE head) | "block" (DFlash drafter) | "suffix"
SOURCES: tuple[Source, ...] = ("head", "block", "suffix")

# Prior acceptance rates, per drafted level. A weak head's: the first bundled head's mean
# acceptance length, 1.55, is a per-level rate near 0.35 (a request's rates start from what
# earlier requests measured, so a stronger head is found without a new prior). Suffix drafts
# are verbatim repeats, accepted far more often when they match at all (SuffixDecoding
# reports 0.6-0.8 on agents).
# A DFlash drafter starts from the head's prior until its own rate is measured.
PRIOR_RATE = {"head": 0.35, "block": 0.35, "suffix": 0.6}
EMA = 0.3            # weight of the newest observation
DRIFT = 0.02         # per unused step, towards the prior
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
EXACT = 16           # verify forwards up to this many tokens are measured per token count


@dataclass
class SourceRate:
    """A per-level acceptance rate (EMA) for one source, for one request."""

    prior: float
    rate: float = -1.0
    accept_length: float = 0.0  # EMA of accepted drafted tokens per step that drafted (reported)
    weight: float = EMA         # of the newest observation

    def __post_init__(self) -> None:
        if self.rate < 0:
            self.rate = self.prior

    def observe(self, accepted: int, rejected: bool) -> None:
        """A step that drafted from this source: ``accepted`` levels passed, then one failed or not."""
        trials = accepted + int(rejected)
        if trials:
            self.rate += self.weight * (accepted / trials - self.rate)
        self.accept_length += self.weight * (accepted - self.accept_length)

    def idle(self) -> None:
        self.rate += DRIFT * (self.prior - self.rate)


def expected_accepted(rates: list[float]) -> float:
    """Expected accepted drafted tokens when level i is accepted with probability rates[i] given
    the levels above it were: sum over i of the product of the first i rates."""
    total, reach = 0.0, 1.0
    for r in rates:
        reach *= r
        total += reach
    return total


@dataclass
class CostCurve:
    """Seconds of a verify forward over n tokens: a prior shape scaled by measurement.

    The prior is a line through (1, one) and (8, eight) (``models/formats.py`` measures those
    two points at start-up; the router interpolates the same way). Measured forwards are
    kept as an EMA of the measured/prior ratio per token count up to ``EXACT``, and per
    power-of-two bucket above. An estimate at a measured count (or bucket) is the prior there
    times its ratio; between measured counts, the line between their estimates; past the
    ends, the prior times the nearest one's ratio. The prior's shape comes from an uncompiled start-up
    measurement and can be far steeper than the served forward's, so it must not carry a
    ratio from one count to another: that made a 2-token verify look dearer than a 3-token one.
    """

    one: float = 1.0
    eight: float = 2.0
    measured: dict[int, float] = field(default_factory=dict)  # count (or bucket) -> EMA of measured / prior

    @classmethod
    def flat(cls) -> "CostCurve":
        """A GPU at small batch: a forward's cost barely depends on its token count."""
        return cls(1.0, 1.0)

    def prior(self, n: int) -> float:
        return max(self.one + (self.eight - self.one) * (n - 1) / 7, 1e-9)

    @staticmethod
    def bucket(n: int) -> int:
        return next((b for b in BUCKETS if n <= b), BUCKETS[-1])

    @staticmethod
    def key(n: int) -> int:
        return n if n <= EXACT else CostCurve.bucket(n)

    def observe(self, n: int, seconds: float) -> None:
        k = self.key(n)
        ratio = seconds / self.prior(n)
        old = self.measured.get(k)
        self.measured[k] = ratio if old is None else old + EMA * (ratio - old)

    def __call__(self, n: int) -> float:
        if not self.measured:
            return self.prior(n)
        k = self.key(n)
        if k in self.measured:
            return self.prior(n) * self.measured[k]
        below = max((m for m in self.measured if m < k), default=None)
        above = min((m for m in self.measured if m > k), default=None)
        if below is None or above is None:
            return self.prior(n) * self.measured[above if below is None else below]
        low, high = self.prior(below) * self.measured[below], self.prior(above) * self.measured[above]
        return low + (high - low) * (n - below) / (above - below)


@dataclass(frozen=True)
class Budget:
    """What one request drafts this step: depth and nodes per source ("head": the request's model
    source, an EAGLE head or a DFlash drafter). All zero: a plain step."""

    head_depth: int = 0
    head_nodes: int = 0
    suffix_depth: int = 0
    suffix_nodes: int = 0

    @property
    def nodes(self) -> int:
        return self.head_nodes + self.suffix_nodes


NO_DRAFT = Budget()


@dataclass(frozen=True)
class Offer:
    """What a source can draft this step: node counts by depth (``nodes[d - 1]`` for depth d),
    its acceptance rate, and the drafting seconds it costs at each depth (0 for suffix lookup)."""

    nodes: tuple[int, ...]
    rate: float
    seconds: tuple[float, ...] = ()

    def cost(self, depth: int) -> float:
        return self.seconds[depth - 1] if depth and self.seconds else 0.0


@dataclass(frozen=True)
class Batch:
    """The rest of the step's forward: its tokens and the tokens it emits."""

    tokens: int = 0
    emitted: float = 0.0


def choose_budget(cost: Callable[[int], float], head: Offer | None, suffix: Offer | None, batch: Batch = Batch(),
                  max_nodes: int = 1 << 30) -> Budget:
    """The (head depth, suffix depth) that maximises the step's expected tokens per second.

    Both sources verify in one tree: where both draft a level, it is accepted if either's
    token is (taken as independent: 1 - (1 - a)(1 - b)); where one drafts, at its rate. The
    step emits the batch's tokens plus 1 + E for this request, in one forward over the
    batch's tokens plus 1 + nodes, plus the head's drafting time.
    """
    head_depths = range(len(head.nodes) + 1) if head is not None else range(1)
    suffix_depths = range(len(suffix.nodes) + 1) if suffix is not None else range(1)
    seen: dict[int, float] = {}  # forward seconds by token count: one curve lookup per count

    def seconds_of(n: int) -> float:
        if n not in seen:
            seen[n] = cost(n)
        return seen[n]

    best, best_speed = NO_DRAFT, (batch.emitted + 1) / seconds_of(batch.tokens + 1)
    for dh in head_depths:
        nh = head.nodes[dh - 1] if dh else 0
        drafting = head.cost(dh) if dh else 0.0
        for ds in suffix_depths:
            if not dh and not ds:
                continue
            ns = suffix.nodes[ds - 1] if ds else 0
            if nh + ns > max_nodes:
                continue
            rates = []
            for level in range(max(dh, ds)):
                miss = (1 - head.rate if level < dh else 1.0) * (1 - suffix.rate if level < ds else 1.0)
                rates.append(1 - miss)
            speed = (batch.emitted + 1 + expected_accepted(rates)) / (seconds_of(batch.tokens + 1 + nh + ns) + drafting)
            if speed > best_speed * (1 + 1e-9):
                best, best_speed = Budget(dh, nh, ds, ns), speed
    return best
