"""How much to draft each step: the verify cost of this host against what the drafts earn.

A speculative step over a tree of n drafted nodes costs one target forward over 1 + n
tokens (plus the draft models' drafting), and earns 1 + E tokens, E the expected accepted
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
* ``SourceRate``: per draft model (the EAGLE head, a DFlash drafter), the request's running
  per-level acceptance rate, an EMA; a source left unused drifts back towards its prior, so a
  source that failed once is tried again later;
* ``MatchRates``: for suffix lookup, whose drafts are verbatim continuations of a matched
  suffix of the context, the per-level acceptance by the length of the match that level
  continues (a level i deep into a draft from a match of m tokens continues a match of
  m + i - 1), learned over every request: a long match is a copy in progress, a one-token
  match little better than a guess;
* ``DraftTiming``: per draft model, the seconds of a steady catch-up and of a drafting unit
  (a forward and its logits);
* the batch: the tokens the rest of the batch puts in the same forward and the tokens it
  emits (from the previous step).

``choose_budget`` is pure: it scores every combination of depths, one per source, by
expected tokens per second of the whole step and returns the best; depth 0 for every
source is a plain ``ar`` step, which it picks whenever drafting cannot pay.

``DraftBudget`` owns all of it for one decoder: the curve, the timings, the rates every
request has measured (a new request starts from them), the probes that keep a source's
rate measured, and the previous step's batch. The decoder asks it for each request's
``Budget`` and reports what the step cost and what each source earned; sources never
time themselves and never decide how much to draft.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence

Source = Literal["head", "block", "suffix", "datastore"]  # the EAGLE head | a DFlash drafter | suffix
# lookup | (only as a lookup's acceptance, ``Reach.lookup``) suffix lookup's drafts from a datastore

# Prior acceptance rates, per drafted level. A weak head's: the first bundled head's mean
# acceptance length, 1.55, is a per-level rate near 0.35 (a request's rates start from what
# earlier requests measured, so a stronger head is found without a new prior). Suffix lookup
# is weighed by match length instead (``MatchRates``); its entry here keeps the request's
# bookkeeping (idle steps, accepted length).
# A DFlash drafter starts from the head's prior until its own rate is measured.
PRIOR_RATE = {"head": 0.35, "block": 0.35, "suffix": 0.6}
EMA = 0.3            # weight of the newest observation
DRIFT = 0.02         # per unused step, towards the prior
# A source with a drafting cost that the budget has left unused for this many of a request's
# steps drafts one level, so its acceptance keeps being measured: a source whose prior says it
# cannot pay would otherwise never be tried, however good it is. The probe costs one extra
# token in one step of this many.
EXPLORE_AFTER = 32
# Weight of one request-step's outcome in the decoder-wide rate that seeds new requests' rates.
LEARNED_EMA = 0.05
STEADY_POSITIONS = 8  # a catch-up over at most this many positions is a drafting request's steady one
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
EXACT = 16           # verify forwards up to this many tokens are measured per token count
# A measured forward moves its count's estimate as if it took at most this factor more (or less)
# than the estimate: one forward stalled by the host (a page fault, a neighbour; 4x the median
# was seen on a 2-core host) must not make a plain step look dear for the steps that follow.
OUTLIER = 1.5
# Match lengths whose acceptance suffix lookup learns apart: each bucket holds the lengths from
# its bound up to the next one's.
MATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24)


@dataclass
class SourceRate:
    """A per-level acceptance rate (EMA) for one source, for one request."""

    prior: float
    rate: float = -1.0
    accept_length: float = 0.0  # EMA of accepted drafted tokens per step that drafted (reported)
    weight: float = EMA         # of the newest observation
    idle_steps: int = 0         # steps since the source last drafted for the request

    def __post_init__(self) -> None:
        if self.rate < 0:
            self.rate = self.prior

    def observe(self, accepted: int, rejected: bool) -> None:
        """A step that drafted from this source: ``accepted`` levels passed, then one failed or not."""
        trials = accepted + int(rejected)
        if trials:
            self.rate += self.weight * (accepted / trials - self.rate)
        self.accept_length += self.weight * (accepted - self.accept_length)
        self.idle_steps = 0

    def idle(self) -> None:
        """A step that did not draft from this source."""
        self.rate += DRIFT * (self.prior - self.rate)
        self.idle_steps += 1

    @property
    def stale(self) -> bool:
        """Left unused for ``EXPLORE_AFTER`` steps: probed when it can be, its backlog dropped when not."""
        return self.idle_steps >= EXPLORE_AFTER


def match_prior(length: int) -> float:
    """The acceptance of a level that continues a match of ``length`` tokens before any is learned:
    1 - 1/(2 length), about half at one token and above 0.9 from six (as measured on the agentic
    and chat prompt sets: 0.48 at one token, 0.6 at two, 0.8 at five, 0.9-0.95 from eight)."""
    return 1.0 - 0.5 / max(length, 1)


def datastore_prior(length: int) -> float:
    """``match_prior`` for a datastore of other prompts' answers, where a match is a shared phrase
    more often than a copy: length / (length + 3), a rough fit (learned over by ``MatchRates``) to
    the bundled datastore's first drafted token on the held-out chat prompts: accepted 0.31 after
    two tokens, 0.47 after four, 0.6-0.66 after six to nine, 0.92 from twelve."""
    return length / (length + 3.0)


MATCH_PRIOR: dict[Source, Callable[[int], float]] = {"suffix": match_prior, "datastore": datastore_prior}


@dataclass
class MatchRates:
    """Acceptance per level of a lookup source by the match length the level continues (an EMA per
    ``MATCH_BUCKETS`` bucket, over every request's drafts)."""

    weight: float = 0.05
    rates: dict[int, float] = field(default_factory=dict)
    prior: Callable[[int], float] = match_prior

    @staticmethod
    def bucket(length: int) -> int:
        return MATCH_BUCKETS[max(bisect_right(MATCH_BUCKETS, length) - 1, 0)]

    def rate(self, length: int) -> float:
        b = self.bucket(length)
        return self.rates.get(b, self.prior(b))

    def levels(self, match: int, depth: int) -> tuple[float, ...]:
        """Per-level rates of a draft ``depth`` deep from a match of ``match`` tokens."""
        return tuple(self.rate(match + i) for i in range(depth))

    def observe(self, match: int, accepted: int, rejected: bool) -> None:
        """A draft from a match of ``match`` tokens: ``accepted`` levels passed, then one failed or not."""
        for i in range(accepted + int(rejected)):
            b = self.bucket(match + i)
            old = self.rates.get(b, self.prior(b))
            self.rates[b] = old + self.weight * (float(i < accepted) - old)


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
    power-of-two bucket above, each observation held within ``OUTLIER`` of the estimate. An
    estimate at a measured count (or bucket) is the prior there times its ratio; between
    measured counts, the line between their estimates; past the ends, the prior times the
    nearest one's ratio. The prior's shape comes from an uncompiled start-up
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
        if old is not None:
            ratio = min(max(ratio, old / OUTLIER), old * OUTLIER)
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
    """What one request drafts this step, per source of the request (in its merge order): depth,
    nodes and drafting units (forwards of a draft model), and the match length each lookup source's
    draft continues (0 for a model). ``reach``: per level of the merged draft, the expected chance
    that verification walks to it (every level above accepted), as the budget weighed it; () where
    the budget weighed nothing (a fixed draft). No depth anywhere: a plain step."""

    depths: tuple[int, ...] = ()
    nodes: tuple[int, ...] = ()
    units: tuple[int, ...] = ()
    matches: tuple[int, ...] = ()
    reach: tuple[float, ...] = ()
    lookups: tuple[Source | None, ...] = ()  # per source, whose acceptance by match length weighs it

    @property
    def num_nodes(self) -> int:
        return sum(self.nodes)

    def depth(self, i: int) -> int:
        """Source i's depth (0 in a plain budget, which may list no sources)."""
        return self.depths[i] if self.depths else 0


NO_DRAFT = Budget()


@dataclass(frozen=True)
class Reach:
    """What a source can draft for one request this step (``DraftSource.offer``): node counts by
    depth (``nodes[d - 1]`` at depth d) and the drafting units each depth costs (``units[d - 1]``;
    () for a source that costs nothing to draft). No nodes: it cannot draft now. ``match``: for a
    lookup source, the length of the context's suffix its draft continues (its acceptance is
    learned by that length, ``MatchRates``); 0 for a model."""

    nodes: tuple[int, ...] = ()
    units: tuple[int, ...] = ()
    match: int = 0
    lookup: Source | None = None  # the acceptance by match length that weighs it (None: the source's own)


NO_REACH = Reach()


@dataclass(frozen=True)
class Offer:
    """A source's reach as ``choose_budget`` weighs it: node counts by depth, its acceptance rate
    (one for every level, or one per level), and the drafting seconds each depth costs (() for a
    free source)."""

    nodes: tuple[int, ...]
    rate: float | tuple[float, ...]
    seconds: tuple[float, ...] = ()

    def level(self, i: int) -> float:
        """The acceptance rate of level i + 1 (given the levels above it were accepted)."""
        return self.rate[i] if isinstance(self.rate, tuple) else self.rate

    def cost(self, depth: int) -> float:
        return self.seconds[depth - 1] if depth and self.seconds else 0.0


@dataclass(frozen=True)
class Batch:
    """The rest of the step's forward: its tokens and the tokens it emits."""

    tokens: int = 0
    emitted: float = 0.0


def choose_budget(cost: Callable[[int], float], offers: Sequence[Offer | None], batch: Batch = Batch(),
                  max_nodes: int = 1 << 30) -> Budget:
    """The depth per source (one per offer, None: cannot draft) that maximises the step's expected
    tokens per second. A request drafts from two sources at most: a draft model and suffix lookup.

    The sources verify in one tree: where both draft a level, it is accepted if either's token is
    (taken as independent: 1 - (1 - a)(1 - b)); where one drafts, at its rate for that level. The step emits the
    batch's tokens plus 1 + E for this request, in one forward over the batch's tokens plus
    1 + nodes, plus the sources' drafting time.

    Every (depth, depth) pair is scored, and this runs per request and step, so E is built from
    shared prefixes (the levels both draft, then the deeper one's), computed in the order
    ``expected_accepted`` would: the same sums, a fraction of the Python.
    """
    if len(offers) > 2:
        raise ValueError("a request drafts from two sources at most: a draft model and suffix lookup")
    a, b = (*offers, None, None)[:2]
    na, nb = len(a.nodes) if a is not None else 0, len(b.nodes) if b is not None else 0
    ra = [1 - (1 - a.level(i)) for i in range(na)]  # a level only a drafts (as 1 - miss, exactly)
    rb = [1 - (1 - b.level(i)) for i in range(nb)]
    # joint[k]: (E, reach) after k levels both draft; alone_a[k][m]: E after m more levels of a alone.
    joint = [(0.0, 1.0)]
    for i in range(min(na, nb)):
        total, reach = joint[-1]
        reach *= 1 - (1 - a.level(i)) * (1 - b.level(i))
        joint.append((total + reach, reach))

    def then(k: int, rates: list[float]) -> list[float]:
        total, reach = joint[k]
        out = [total]
        for rate in rates[k:]:
            reach *= rate
            total += reach
            out.append(total)
        return out

    alone_a = [then(k, ra) for k in range(min(na, nb + 1))]  # k = b's depth < a's
    alone_b = [then(k, rb) for k in range(min(nb, na + 1))]
    seen: dict[int, float] = {}  # forward seconds by token count: one curve lookup per count

    def seconds_of(n: int) -> float:
        if n not in seen:
            seen[n] = cost(n)
        return seen[n]

    best, best_speed = (0, 0), (batch.emitted + 1) / seconds_of(batch.tokens + 1)
    for da in range(na + 1):
        nodes_a = a.nodes[da - 1] if da else 0
        drafting = a.cost(da) if da else 0.0
        for db in range(nb + 1):
            if not da and not db:
                continue
            nodes = nodes_a + (b.nodes[db - 1] if db else 0)
            if nodes > max_nodes:
                continue
            accepted = alone_a[db][da - db] if da > db else alone_b[da][db - da] if db > da else joint[da][0]
            speed = (batch.emitted + 1 + accepted) / (seconds_of(batch.tokens + 1 + nodes) + drafting
                                                      + (b.cost(db) if db else 0.0))
            if speed > best_speed * (1 + 1e-9):
                best, best_speed = (da, db), speed
    depths = best[:len(offers)]
    return Budget(depths, tuple(o.nodes[d - 1] if d else 0 for o, d in zip(offers, depths)),
                  reach=level_reach(a, b, *best))


def level_reach(a: Offer | None, b: Offer | None, da: int, db: int) -> tuple[float, ...]:
    """Per level of a draft ``da`` deep from ``a`` and ``db`` from ``b``, the chance that every level
    down to it is accepted (``choose_budget``'s independence rule where both draft a level)."""
    out, reach = [], 1.0
    for i in range(max(da, db)):
        miss = (1 - a.level(i) if i < da else 1.0) * (1 - b.level(i) if i < db else 1.0)
        reach *= 1 - miss
        out.append(reach)
    return tuple(out)


@dataclass
class DraftTiming:
    """One draft model's measured drafting time (EMAs): a steady catch-up, and a unit (a forward
    and its logits; an EAGLE head spends one per level, a DFlash drafter one per block)."""

    unit: float | None = None
    catch_up: float | None = None

    def observe_catch_up(self, seconds: float, positions: float) -> None:
        """A catch-up over ``positions`` unseen positions took ``seconds``. Only a drafting request's
        steady catch-up (the few positions its last step committed) trains the estimate: a backlog
        left by plain steps is paid once, when drafting resumes, not every step."""
        if 0 < positions <= STEADY_POSITIONS:
            self.catch_up = seconds if self.catch_up is None else self.catch_up + EMA * (seconds - self.catch_up)

    def observe_units(self, seconds: float, units: int) -> None:
        """This step's drafts, ``units`` drafting units in all, took ``seconds`` (catch-up not included)."""
        if units:
            per = seconds / units
            self.unit = per if self.unit is None else self.unit + EMA * (per - self.unit)

    def seconds(self, units: int, target_step: float) -> float:
        """Expected drafting seconds for ``units`` units, a steady catch-up included; before any
        measurement, a guess from the target's one-token step: the catch-up and a unit each cost a
        quarter of it (one layer and the logits)."""
        unit = self.unit if self.unit is not None else 0.25 * target_step
        catch_up = self.catch_up if self.catch_up is not None else 0.25 * target_step
        return catch_up + unit * units


class DraftBudget:
    """How much each request drafts each step, from what drafting costs and earns on this host.

    ``curve`` None: every step drafts everything each source offers (a fixed tree, for
    measuring acceptance); a ``CostCurve``: ``choose_budget`` sizes each step, down to a plain
    step, and the curve learns from the verify forwards the decoder times.
    """

    def __init__(self, curve: CostCurve | None):
        self.curve = curve
        # Each source's per-level acceptance over every request so far: a new request's rates start here.
        self.learned: dict[Source, SourceRate] = {s: SourceRate(p, weight=LEARNED_EMA) for s, p in PRIOR_RATE.items()}
        self.timing: dict[Source, DraftTiming] = {s: DraftTiming() for s in PRIOR_RATE}
        self.by_match: dict[Source, MatchRates] = {}  # a lookup source's acceptance by match length
        self._last = (0, 0, 0)  # the previous step: requests, forward tokens, tokens emitted

    def rates(self) -> dict[Source, SourceRate]:
        """A new request's running rates, each starting from (and drifting back to) the learned one."""
        return {s: SourceRate(r.rate) for s, r in self.learned.items()}

    def choose(self, names: Sequence[Source], reaches: Sequence[Reach], rates: dict[Source, SourceRate],
               cap: int) -> Budget:
        """This step's budget for a request whose sources (``names``) can reach ``reaches``, within
        ``cap`` nodes."""
        if self.curve is None:  # fixed sizes: everything on offer
            return Budget(tuple(len(r.nodes) for r in reaches), tuple(r.nodes[-1] if r.nodes else 0 for r in reaches),
                          tuple(r.units[-1] if r.units else 0 for r in reaches), tuple(r.match for r in reaches),
                          lookups=tuple(r.lookup for r in reaches))
        step = self.curve(1)
        offers = [Offer(r.nodes, self._rate(name, r, rates[name]), tuple(self.timing[name].seconds(u, step) for u in r.units))
                  if r.nodes else None for name, r in zip(names, reaches)]
        budget = choose_budget(self.curve, offers, self._others(), cap)
        depths, nodes = list(budget.depths), list(budget.nodes)
        for i, (name, r) in enumerate(zip(names, reaches)):  # a probe (EXPLORE_AFTER) of a stale model
            if r.units and r.nodes and not depths[i] and rates[name].stale and sum(nodes) + r.nodes[0] <= cap:
                depths[i], nodes[i] = 1, r.nodes[0]
        units = tuple(r.units[d - 1] if d and r.units else 0 for r, d in zip(reaches, depths))
        return Budget(tuple(depths), tuple(nodes), units, tuple(r.match for r in reaches), budget.reach,
                      tuple(r.lookup for r in reaches))

    def _by_match(self, name: Source) -> MatchRates:
        """A lookup source's acceptance by match length, from its own prior."""
        if name not in self.by_match:
            self.by_match[name] = MatchRates(prior=MATCH_PRIOR.get(name, match_prior))
        return self.by_match[name]

    def _rate(self, name: Source, reach: Reach, rate: SourceRate) -> float | tuple[float, ...]:
        """A source's acceptance as the budget weighs it: a model's running rate, or per level by
        the match it continues for a lookup source."""
        if not reach.match:
            return rate.rate
        return self._by_match(reach.lookup or name).levels(reach.match, len(reach.nodes))

    def _others(self) -> Batch:
        """The rest of the batch, as the previous step had it."""
        n, tokens, emitted = self._last
        if n <= 1:
            return Batch()
        share = (n - 1) / n
        return Batch(round(tokens * share), emitted * share)

    # ---- what the step measured ------------------------------------------------------

    def caught_up(self, name: Source, seconds: float, positions: int, requests: int) -> None:
        """A source's catch-up over ``positions`` positions of ``requests`` requests took ``seconds``
        (a share each)."""
        self.timing[name].observe_catch_up(seconds / requests, positions / requests)

    def drafted(self, seconds: float, units: dict[Source, int]) -> None:
        """The step's drafting took ``seconds``, spending these units per source: at batch 1 the
        step's drafting is that request's."""
        for name, n in units.items():
            self.timing[name].observe_units(seconds, n)

    def verified(self, tokens: int, seconds: float) -> None:
        """A verify forward of decode steps over ``tokens`` tokens took ``seconds``."""
        if self.curve is not None:
            self.curve.observe(tokens, seconds)

    def stepped(self, requests: int, tokens: int, emitted: int) -> None:
        """The step's batch, which the next step's budgets take as the rest of theirs."""
        self._last = (requests, tokens, emitted)

    def record(self, name: Source, rate: SourceRate, outcome: tuple[int, bool] | None, match: int = 0,
               lookup: Source | None = None) -> None:
        """What a request's source earned in a verified step: ``source_outcome``, None where it
        drafted nothing; ``match``: the match length its draft continued (``Reach.match``), learned
        under ``lookup`` (``Reach.lookup``; None: the source's name)."""
        if outcome is None:
            rate.idle()
            return
        rate.observe(*outcome)
        self.learned[name].observe(*outcome)
        if match:
            self._by_match(lookup or name).observe(match, *outcome)
