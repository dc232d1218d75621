"""EAGLE-2 draft trees and the acceptance rules that verify them, as small pure pieces.

Trees from several draft sources (a draft model, suffix lookup) are merged into one
(``merge_trees``) before the verify forward; each node remembers which sources
proposed it, so each source's acceptance can be tracked (``source_outcome``).

Growing a tree (EAGLE-2, Li et al. 2024, section 4; upstream ``cnets.py``
``topK_genrate``): from the head's output at the root, take the top-k tokens;
then ``depth - 1`` times, feed the current frontier (k nodes) through the head,
take each node's top-k children, score every child by the *cumulative* draft
log-probability of its path, and keep the k best children as the next frontier.
Every scored node joins a candidate pool; the best ``num_nodes`` of the pool are
verified. A child never scores above its parent and sits later in the pool, so a
stable sort by score keeps parents before children: the selection is a tree.

Verifying it (``accept_greedy`` / ``accept_sampled``): one target forward over
root + nodes gives the target's distribution at every node; walk down from the
root while a child holds the token the target itself picks at that node, then
add the target's token where the walk stops (the "bonus"). At temperature 0 the
target picks its argmax: the longest path whose every token is the argmax. At
temperature > 0 it picks its sample at that output position, drawn by inverse
CDF with the one uniform keyed by (request seed, position)
(``sampling.keyed_uniform``): a draft is accepted iff it equals that sample.
The emitted tokens are then exactly the tokens plain AR samples with the same
seed, whatever the tree's shape or the batch (lossless in the strong sense, not
only in distribution). Against EAGLE's and SpecInfer's rejection sampling with
point-mass drafts (accept child x with probability p(x), else zero it and
renormalise), the chance that some child is accepted is the same, sum p(x) over
the children, so the budget's acceptance estimates are unchanged.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..engine.sampling import argmax, inverse_cdf


@dataclass(frozen=True)
class TreeConfig:
    depth: int = 5          # longest draft path (tokens after the root)
    top_k: int = 4          # children per expanded node, and frontier width
    num_nodes: int = 16     # drafted tokens verified per step (the root is extra)

    def __post_init__(self) -> None:
        if self.depth < 1 or self.top_k < 1 or self.num_nodes < 1:
            raise ValueError("depth, top_k and num_nodes must be positive")
        if self.num_nodes > self.pool_size:
            raise ValueError(f"num_nodes={self.num_nodes} exceeds the {self.pool_size} candidates a tree of "
                             f"depth {self.depth} and top_k {self.top_k} can hold")

    @property
    def pool_size(self) -> int:
        return self.top_k + (self.depth - 1) * self.top_k ** 2

    @classmethod
    def chain(cls, depth: int) -> "TreeConfig":
        """Chain drafting: one path of ``depth`` tokens (top_k = 1)."""
        return cls(depth=depth, top_k=1, num_nodes=depth)


@dataclass
class DraftTree:
    """Root first, parents before children. ``parents[0] == -1``; tokens are target ids."""

    tokens: list[int]
    parents: list[int]
    depths: list[int] = field(default_factory=list)
    sources: list[int] = field(default_factory=list)  # per node, a bit per draft source that proposed it

    def __post_init__(self) -> None:
        if not self.depths:
            self.depths = [0]
            for p in self.parents[1:]:
                self.depths.append(self.depths[p] + 1)

    def __len__(self) -> int:
        return len(self.tokens)

    def mask(self) -> torch.Tensor:
        """(nodes, nodes) bool: node i may attend to node j iff j is i or an ancestor of i."""
        n = len(self.tokens)
        m = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            m[i] |= m[self.parents[i]]
        return m

    def children(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.tokens]
        for i, p in enumerate(self.parents[1:], start=1):
            out[p].append(i)
        return out

    def cut(self, num_nodes: int, max_depth: int | None = None) -> "DraftTree":
        """The first ``num_nodes`` drafted nodes no deeper than ``max_depth``: parents come first, so
        a prefix of the node order (less the too deep ones) is still a tree."""
        keep = [i for i in range(len(self.tokens)) if max_depth is None or self.depths[i] <= max_depth]
        keep = keep[:num_nodes + 1]
        index = {old: new for new, old in enumerate(keep)}
        return DraftTree([self.tokens[i] for i in keep], [index.get(self.parents[i], -1) for i in keep],
                         [self.depths[i] for i in keep], [self.sources[i] for i in keep] if self.sources else [])


def merge_trees(trees: list[DraftTree]) -> DraftTree:
    """One tree holding every node of ``trees`` (which share the root), shared prefixes once.

    Node ``sources`` gets bit s for each ``trees[s]`` that proposed it. Every node keeps distinct
    tokens among its children, as the acceptance rules need: a second child with a token
    already tried would be skipped, and its subtree lost with it.
    """
    tokens, parents, sources = [trees[0].tokens[0]], [-1], [(1 << len(trees)) - 1]
    child_of: dict[tuple[int, int], int] = {}
    for s, tree in enumerate(trees):
        if tree.tokens[0] != tokens[0]:
            raise ValueError("merged trees must share their root")
        where = [0]
        for i in range(1, len(tree)):
            key = (where[tree.parents[i]], tree.tokens[i])
            node = child_of.get(key)
            if node is None:
                node = child_of[key] = len(tokens)
                tokens.append(tree.tokens[i])
                parents.append(key[0])
                sources.append(0)
            sources[node] |= 1 << s
            where.append(node)
    return DraftTree(tokens, parents, sources=sources)


def source_outcome(tree: DraftTree, path: list[int], source: int) -> tuple[int, bool] | None:
    """(accepted nodes the source proposed, whether it proposed a child where acceptance stopped),
    or None when it proposed nothing. Its accepted nodes are a prefix of the path: a node
    proposed by a source has its ancestors proposed by it too."""
    bit = 1 << source
    if not any(s & bit for s in tree.sources[1:]):
        return None
    accepted = sum(1 for n in path if tree.sources[n] & bit)
    stop = path[accepted - 1] if accepted else 0  # the last accepted node it proposed, or the root
    return accepted, any(tree.sources[c] & bit for c in tree.children()[stop])


def select_nodes(scores: torch.Tensor, num: int) -> torch.Tensor:
    """Indices of the ``num`` best pool entries, ascending (so parents come first).

    The stable sort breaks score ties by pool index, and a parent's index is
    always below its children's: a selected child's parent is always selected.
    """
    order = torch.sort(-scores, stable=True).indices[:num]
    return order.sort().values


# What growing a tree asks of the head: feed the frontier, (target ids (k,), hidden (k, hidden),
# level, visibility (k, fed) over the nodes fed before, in feeding order) -> (h (k, hidden),
# draft log-probabilities (k, draft vocab)). ``head_graph.draft_tree`` runs it as one graph.
Expand = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def grow_tree(expand: Expand, to_target: Callable[[torch.Tensor], torch.Tensor], root: int,
              root_logp: torch.Tensor, root_hidden: torch.Tensor, config: TreeConfig, max_depth: int) -> DraftTree:
    """EAGLE-2 dynamic tree from the head's output at the root: ``root_hidden`` (hidden,) and its
    draft log-probabilities ``root_logp`` (draft vocab,).

    Level ``level`` (1-based) feeds the frontier to the head (``expand``; a node at depth d is fed
    at RoPE position root + d - 1: the head's pair convention, feature j with token j+1 at
    position j). ``max_depth`` caps the depth (no point drafting past max_tokens).
    """
    depth = min(config.depth, max_depth)
    if depth < 1:
        return DraftTree([root], [-1])
    k = config.top_k
    scores, ids = root_logp.topk(k)  # level 1: (k,)
    if depth == 1:  # the root's best children, best first: what selecting from the pool below picks
        n = min(config.num_nodes, k)
        return DraftTree([root] + to_target(ids[:n]).tolist(), [-1] + [0] * n)
    pool_scores, pool_ids, pool_parent = [scores], [ids], [torch.full((k,), -1)]  # parent = pool index
    frontier = torch.arange(k)          # pool indices of the frontier
    frontier_hidden = root_hidden[None].expand(k, -1).contiguous()
    fed_rows: list[torch.Tensor] = []   # per fed node: its visibility row over fed nodes
    ancestors_of = {}                   # pool index -> fed index, for fed nodes
    offset = k
    for level in range(1, depth):
        tokens = torch.cat(pool_ids)[frontier]
        visible = _visible_rows(frontier, torch.cat(pool_parent), ancestors_of, len(fed_rows), fed_rows)
        out, logp = expand(to_target(tokens), frontier_hidden, level, visible)
        for j, f in enumerate(frontier.tolist()):
            ancestors_of[f] = len(fed_rows) - k + j
        child_logp, child_ids = logp.topk(k, dim=-1)  # (k, k)
        cum = (child_logp + scores[:, None]).reshape(-1)  # (k * k,) cumulative path log-prob
        pool_scores.append(cum)
        pool_ids.append(child_ids.reshape(-1))
        pool_parent.append(frontier.repeat_interleave(k))
        scores, best = cum.topk(k)
        frontier = offset + best.cpu()  # tree bookkeeping stays on the CPU, whatever the device
        frontier_hidden = out[best // k]
        offset += k * k
    all_scores, all_ids, all_parent = torch.cat(pool_scores), torch.cat(pool_ids), torch.cat(pool_parent)
    chosen = select_nodes(all_scores, min(config.num_nodes, len(all_scores)))
    tree_index = {int(c): i + 1 for i, c in enumerate(chosen.tolist())}
    parents = [-1] + [tree_index.get(int(all_parent[c]), 0) for c in chosen.tolist()]
    tokens = [root] + to_target(all_ids[chosen]).tolist()
    return DraftTree(tokens, parents)


def _visible_rows(frontier: torch.Tensor, parent: torch.Tensor, fed_index: dict, num_fed: int,
                  fed_rows: list[torch.Tensor]) -> torch.Tensor:
    """Visibility of the frontier over already fed nodes: the fed ancestors of each frontier node.

    Appends each frontier node's own row (ancestors + itself) to ``fed_rows``.
    """
    rows = []
    for f in frontier.tolist():
        p = int(parent[f])
        row = torch.zeros(num_fed, dtype=torch.bool)
        if p >= 0:
            parent_row = fed_rows[fed_index[p]]  # as long as the fed count when the parent was fed
            row[:len(parent_row)] = parent_row
        rows.append(row)
    visible = torch.stack(rows) if rows else torch.zeros(0, num_fed, dtype=torch.bool)  # (k, fed)
    total = num_fed + len(rows)
    for j, row in enumerate(rows):
        full = torch.zeros(total, dtype=torch.bool)
        full[:num_fed] = row
        full[num_fed + j] = True
        fed_rows.append(full)
    return visible


# ---- verification's logits -----------------------------------------------------------

def path_logits(starts: dict, final: torch.Tensor, logits_of: Callable[[torch.Tensor], torch.Tensor],
                cost: Callable[[int], float]) -> tuple[dict, dict]:
    """Per key of ``starts`` (key -> (row of its tree's root in ``final``, tree, reach)), the
    target's logits by node along the path verification will most likely walk: the root, then each
    node whose token is its parent's argmax; and those argmaxes by node (greedy acceptance reuses
    them). ``reach``: per tree level, the chance that verification walks to it (``Budget.reach``),
    or None for a draft nobody weighed (taken as certain); ``cost``: seconds of one output-head
    product by its rows (measured).

    One output-head product per tree level for every tree at once: at 16 streams, a product per
    request and node cost more than a sixth of the step (the head at one row is a fifth of a
    forward). A product also computes each tree's likely next nodes ahead (``likely_chain``) while
    a node's chance of being needed, given the walk has reached the current one, times the cost of
    another product (its share of it, when several walks go on) is more than the row adds to this
    one: where the product is bound by reading the output head (a 262k-token vocabulary: 16 rows
    cost 1.2x one) a likely chain is computed whole, where it is bound by compute (the default
    model on a 2-core host: a row adds a tenth to a fifth of a product) only its likely first
    levels are. Acceptance computes any other node it reaches itself, so the rows chosen here
    change the cost, never the result.
    """
    cost = functools.cache(cost)  # one curve lookup per row count
    children = {k: tree.children() for k, (_, tree, _) in starts.items()}
    heights = {k: subtree_heights(children[k]) for k in starts}
    out: dict = {k: {} for k in starts}
    argmaxes: dict = {k: {} for k in starts}
    frontier = {k: 0 for k in starts}  # key -> the node its walk has reached
    while frontier:
        # What a node left for later can cost: another product, shared by the walks still going.
        another = cost(1) / len(frontier)
        rows_now = len(frontier)
        chains = {}
        for k, node in frontier.items():
            tree, reach = starts[k][1], starts[k][2]
            chain = likely_chain(children[k], heights[k], node, len(tree))
            here = tree.depths[node]
            keep = 1
            for c in chain[1:]:
                chance = 1.0 if reach is None else _chance(reach, here, tree.depths[c])
                if chance * another < cost(rows_now + 1) - cost(rows_now):
                    break
                keep, rows_now = keep + 1, rows_now + 1
            chains[k] = chain[:keep]
        rows = torch.tensor([starts[k][0] + c for k in frontier for c in chains[k]], device=final.device)
        logits = logits_of(final[rows])
        best = argmax(logits)
        following, i = {}, 0
        for k, node in frontier.items():
            tree, index = starts[k][1], {}
            for c in chains[k]:
                out[k][c], argmaxes[k][c], index[c] = logits[i], best[i], i
                i += 1
            while True:  # walk the argmax path through the rows just computed
                child = next((c for c in children[k][node] if tree.tokens[c] == best[index[node]]), None)
                if child is None:
                    break
                if child not in index:
                    following[k] = child
                    break
                node = child
        frontier = following
    return out, argmaxes


def _chance(reach: Sequence[float], here: int, depth: int) -> float:
    """The chance that verification walks from a node at level ``here`` down to level ``depth``."""
    def at(level: int) -> float:
        return 1.0 if level == 0 else reach[level - 1] if level <= len(reach) else 0.0
    return at(depth) / at(here) if at(here) > 0 else 0.0


def subtree_heights(children: list[list[int]]) -> list[int]:
    """Per node, the levels below it (0 for a leaf); parents come before children in a tree's order."""
    heights = [0] * len(children)
    for node in range(len(children) - 1, -1, -1):
        if children[node]:
            heights[node] = 1 + max(heights[c] for c in children[node])
    return heights


def likely_chain(children: list[list[int]], heights: list[int], node: int, ahead: int) -> list[int]:
    """``node`` and up to ``ahead`` nodes below it, each the child with the deepest subtree (the
    first such): a suffix draft's continuation, or the head's highest-scoring branch."""
    chain = [node]
    while len(chain) <= ahead and children[chain[-1]]:
        chain.append(max(children[chain[-1]], key=lambda c: heights[c]))
    return chain


# ---- acceptance ------------------------------------------------------------------

Dist = Callable[[int, list[int]], torch.Tensor]  # (node, tokens accepted so far) -> (vocab,) logits or probs
Pick = Callable[[int, list[int]], int]  # (node, tokens accepted so far) -> the target's token after that node


def accept_walk(tree: DraftTree, pick: Pick) -> tuple[list[int], int]:
    """Walk down from the root while a child holds the target's token (``pick``); returns
    (accepted node indices, bonus token: the target's token where the walk stopped)."""
    children = tree.children()
    node, path, tokens = 0, [], []
    while True:
        token = pick(node, tokens)
        nxt = next((c for c in children[node] if tree.tokens[c] == token), None)
        if nxt is None:
            return path, token
        node = nxt
        path.append(node)
        tokens.append(token)


def accept_greedy(tree: DraftTree, logits_at: Dist, known: dict[int, int] | None = None) -> tuple[list[int], int]:
    """Longest path of target-argmax tokens; returns (accepted node indices, bonus token).
    ``known``: argmaxes of ``logits_at`` already taken, by node (``path_logits``)."""
    def best(node: int, tokens: list[int]) -> int:
        return known[node] if known and node in known else int(argmax(logits_at(node, tokens)))
    return accept_walk(tree, best)


def accept_sampled(tree: DraftTree, probs_at: Dist, uniforms: Sequence[float]) -> tuple[list[int], int]:
    """Keyed acceptance: returns (accepted node indices, bonus token).

    The target's token after a node at depth d is ``inverse_cdf(probs_at(node, accepted), uniforms[d])``,
    where ``uniforms[d]`` is the keyed uniform of the output position d steps past the root
    (``sampling.keyed_uniform(seed, t0 + d)``; at least ``max(tree.depths) + 1`` of them). A drafted
    child is accepted iff its token equals that sample; the first position whose sample no child
    holds emits the sample as the bonus. Every position's sample is a function of (its distribution,
    its uniform) alone, so the emitted tokens are exactly plain sampling's with the same uniforms,
    whatever the tree drafted (see the module docstring)."""
    return accept_walk(tree, lambda node, tokens: inverse_cdf(probs_at(node, tokens), uniforms[len(tokens)]))
