"""BlockPool: allocation round-trips, prefix reuse, LRU eviction, lookahead and truncation.

Pure Python (no torch). The randomized test drives many tables through the
operations an engine performs and checks the pool's invariants after each one.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dualserve.decoders.engine.blocks import BlockPool, BlockTable, NoFreeBlocks, slot_of

BS = 4


def admit(pool: BlockPool, token_ids: list[int], lookahead: int = 0) -> BlockTable:
    """Admit a whole prompt the way the engine does: size the chunk by the cache hit."""
    table = BlockTable(blocks=[])
    _, hit = pool.match_prefix(token_ids)
    pool.allocate(table, token_ids, len(token_ids) - hit, lookahead)
    return table


def test_allocate_commit_free_round_trip():
    pool = BlockPool(num_blocks=8, block_size=BS)
    prompt = list(range(10))
    table = admit(pool, prompt)
    assert table.blocks == [0, 1, 2] and table.num_tokens == 0 and table.num_cached_tokens == 0
    assert pool.num_used_blocks == 3 and pool.num_free_blocks == 5 and pool.usage() == 3 / 8
    assert pool.slot_mapping(table, 3, 6) == [3, 4, 5]
    pool.mark_written(table, prompt, 10)
    # Decode two tokens: the 11th and 12th fit the third block, the 13th needs a fourth.
    seq = prompt + [100, 101, 102]
    for n in (11, 12, 13):
        pool.allocate(table, seq, 1)
        pool.mark_written(table, seq, n)
    assert len(table.blocks) == 4 and pool.slot_mapping(table, 12, 13) == [table.blocks[3] * BS]
    pool.check([table])
    pool.free(table)
    assert table.blocks == [] and table.num_tokens == 0 and table.num_cached_tokens == 0
    assert pool.num_free_blocks == 8 and pool.num_used_blocks == 0
    pool.check([])


def test_slot_mapping_rejects_unreserved_positions():
    pool = BlockPool(num_blocks=4, block_size=BS)
    table = admit(pool, [1, 2, 3])
    with pytest.raises(IndexError):
        pool.slot_mapping(table, 0, BS + 1)


def test_prefix_reuse_covers_full_blocks_only():
    pool = BlockPool(num_blocks=16, block_size=BS)
    shared = list(range(100, 110))  # 2 full blocks + 2 tokens
    a = admit(pool, shared + [1, 2])
    pool.mark_written(a, shared + [1, 2], 12)
    b_prompt = shared + [7, 8, 9]
    blocks, hit = pool.match_prefix(b_prompt)
    assert blocks == a.blocks[:2] and hit == 8
    b = admit(pool, b_prompt)
    assert b.num_cached_tokens == 8 and b.num_tokens == 8 and b.blocks[:2] == a.blocks[:2]
    assert len(b.blocks) == 4 and pool.stats.hits == 8 and pool.stats.queries == 12 + 13
    pool.check([a, b])
    pool.free(a)
    pool.free(b)
    assert pool.num_free_blocks == 16
    pool.check([])


def test_fully_cached_prompt_recomputes_its_last_block():
    pool = BlockPool(num_blocks=8, block_size=BS)
    prompt = list(range(8))
    a = admit(pool, prompt)
    pool.mark_written(a, prompt, 8)
    pool.free(a)
    _, hit = pool.match_prefix(prompt)
    assert hit == 4  # not 8: one token must stay to produce logits
    _, hit = pool.match_prefix(prompt + [9])
    assert hit == 8


def test_match_prefix_has_no_side_effects():
    pool = BlockPool(num_blocks=8, block_size=BS)
    prompt = list(range(9))
    a = admit(pool, prompt)
    pool.mark_written(a, prompt, 9)
    pool.free(a)
    before = (pool.num_free_blocks, pool.stats.queries, pool.stats.hits, list(pool._evictable))
    pool.match_prefix(prompt)
    assert (pool.num_free_blocks, pool.stats.queries, pool.stats.hits, list(pool._evictable)) == before


def test_chained_hash_depends_on_position():
    pool = BlockPool(num_blocks=8, block_size=BS)
    block = [5, 6, 7, 8]
    a = admit(pool, block + block + [1])
    pool.mark_written(a, block + block + [1], 9)
    # The same four tokens as a first block hit; after a different first block they do not.
    assert pool.match_prefix(block + [0])[1] == 4
    assert pool.match_prefix([0, 0, 0, 0] + block + [0])[1] == 0
    # Both cached blocks hold the same tokens yet are distinct entries.
    assert pool.match_prefix(block + block + [0]) == (a.blocks[:2], 8)


def test_duplicate_block_stays_uncached_and_is_freed():
    pool = BlockPool(num_blocks=8, block_size=BS)
    prompt = list(range(5))
    a = admit(pool, prompt)
    b = admit(pool, prompt)  # a has not committed yet: no hit, separate blocks
    pool.mark_written(a, prompt, 5)
    pool.mark_written(b, prompt, 5)
    pool.free(b)
    assert pool.match_prefix(prompt + [0])[0] == a.blocks[:1]
    assert len(pool._evictable) == 0 and pool.num_free_blocks == 8 - 2
    pool.check([a])


def test_lru_eviction_of_unreferenced_cached_blocks():
    pool = BlockPool(num_blocks=4, block_size=BS)
    old, new = [1] * 8, [2] * 8
    for prompt in (old, new):
        t = admit(pool, prompt)
        pool.mark_written(t, prompt, 8)
        pool.free(t)
    old_blocks = pool.match_prefix(old + [0])[0]
    assert pool.num_free_blocks == 4 and len(pool._evictable) == 4
    # Tail blocks were freed first, so the old request's second block goes first.
    t = admit(pool, [9])
    assert t.blocks == [old_blocks[1]] and pool.stats.evictions == 1
    assert pool.match_prefix(old + [0])[1] == 4 and pool.match_prefix(new + [0])[1] == 8
    # Reusing the old first block takes it out of the LRU; the new blocks go next, tail first.
    new_blocks = pool.match_prefix(new + [0])[0]
    u = admit(pool, old[:4] + [3])
    assert u.blocks == [old_blocks[0], new_blocks[1]] and u.num_cached_tokens == 4
    v = admit(pool, [8])
    assert v.blocks == [new_blocks[0]] and pool.stats.evictions == 3
    assert pool.num_free_blocks == 0
    pool.check([t, u, v])


def test_free_blocks_are_used_before_evicting():
    pool = BlockPool(num_blocks=4, block_size=BS)
    a = admit(pool, [1] * 5)
    pool.mark_written(a, [1] * 5, 5)
    pool.free(a)
    b = admit(pool, [2] * 8)
    assert pool.stats.evictions == 0 and pool.match_prefix([1] * 5)[1] == 4
    pool.check([b])


def test_no_free_blocks_is_all_or_nothing():
    pool = BlockPool(num_blocks=4, block_size=BS)
    cached = [7] * 9
    a = admit(pool, cached)
    pool.mark_written(a, cached, 9)
    pool.free(a)
    b = admit(pool, [1] * 4)
    state = (list(pool._free), list(pool._evictable), list(pool._ref), dict(pool._cached), replace(pool.stats))
    c = BlockTable(blocks=[])
    # Hit 8 tokens (2 evictable blocks) + 9 new tokens = 5 blocks: 3 more, but 1 would be left.
    with pytest.raises(NoFreeBlocks):
        pool.allocate(c, cached + [0] * 8, 9)
    with pytest.raises(NoFreeBlocks):
        pool.allocate(b, [1] * 4, 17)  # 5 blocks in all
    assert c == BlockTable(blocks=[]) and len(b.blocks) == 1
    assert (list(pool._free), list(pool._evictable), list(pool._ref), dict(pool._cached), pool.stats) == state
    pool.allocate(c, cached + [0] * 4, 4)  # hit 8 + 4 new tokens = 3 blocks: they are there
    assert c.num_cached_tokens == 8 and len(c.blocks) == 3
    pool.check([b, c])


def test_lookahead_slots_then_truncate_releases_them():
    pool = BlockPool(num_blocks=8, block_size=BS)
    seq = list(range(6))
    t = admit(pool, seq)
    pool.mark_written(t, seq, 6)
    # Verify 1 token plus 5 draft tokens: slots up to position 12 -> 3 blocks.
    pool.allocate(t, seq, 1, num_lookahead=5)
    assert len(t.blocks) == 3 and t.num_tokens == 6
    seq += [50, 51]  # two tokens accepted
    pool.mark_written(t, seq, 8)
    pool.truncate(t, 8)
    assert len(t.blocks) == 2 and t.num_tokens == 8 and pool.num_used_blocks == 2
    pool.check([t])
    # Rolling committed tokens back re-opens a block; its stale cache entry goes.
    pool.truncate(t, 5)
    assert t.num_tokens == 5 and len(t.blocks) == 2 and pool.match_prefix(seq + [0])[1] == 4
    pool.check([t])
    pool.free(t)
    assert pool.num_free_blocks == 8


def test_slot_of_is_block_id_times_size_plus_offset():
    table = BlockTable(blocks=[5, 2, 7])
    pool = BlockPool(num_blocks=8, block_size=BS)
    assert [slot_of(table.blocks, p, BS) for p in (0, 3, 4, 9)] == [20, 23, 8, 29]
    assert pool.slot_mapping(table, 3, 6) == [23, 8, 9]


def test_computed_tokens_peeks_at_the_prefix_cache():
    pool = BlockPool(num_blocks=8, block_size=BS)
    prompt = list(range(9))
    a = admit(pool, prompt)
    pool.mark_written(a, prompt, 7)
    assert pool.computed_tokens(a, prompt) == 7  # a table with blocks: what it has written
    pool.mark_written(a, prompt, 9)
    state = (list(pool._free), list(pool._evictable), list(pool._ref), replace(pool.stats))
    fresh = BlockTable(blocks=[])
    assert pool.computed_tokens(fresh, prompt + [1]) == 8  # two full blocks cached
    assert pool.computed_tokens(fresh, prompt + [1], use_prefix_cache=False) == 0
    assert fresh == BlockTable(blocks=[])
    assert (list(pool._free), list(pool._evictable), list(pool._ref), pool.stats) == state


def test_hash_collision_is_not_a_hit(monkeypatch):
    pool = BlockPool(num_blocks=4, block_size=BS)
    monkeypatch.setattr(pool, "_block_key", lambda parent, tokens: 0)
    a = admit(pool, [1, 2, 3, 4, 5])
    pool.mark_written(a, [1, 2, 3, 4, 5], 5)
    assert pool.match_prefix([5, 6, 7, 8, 9]) == ([], 0)
    assert pool.match_prefix([1, 2, 3, 4, 9]) == (a.blocks[:1], 4)


def test_prefix_caching_disabled():
    pool = BlockPool(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    prompt = list(range(9))
    t = admit(pool, prompt)
    pool.mark_written(t, prompt, 9)
    pool.free(t)
    assert pool.match_prefix(prompt) == ([], 0) and len(pool._free) == 4
    pool.check([])


# ---- randomized stress ---------------------------------------------------------------

ops_strategy = st.lists(
    st.tuples(
        st.sampled_from(["admit", "step", "reserve", "truncate", "free"]),
        st.integers(0, 7),  # which live table
        st.integers(0, 9),  # a size
    ),
    min_size=1,
    max_size=80,
)


class FakeKV:
    """Stands in for the runner's KV tensors: slot -> the prefix whose KV it holds.

    The KV at position p depends on tokens [0, p], so a slot stores that tuple;
    reading a table's written slots back checks sharing, prefix hits and
    truncation end to end.
    """

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.slots: dict[int, tuple[int, ...]] = {}

    def write(self, t: BlockTable, seq: list[int], start: int, end: int) -> None:
        for p, slot in zip(range(start, end), self.pool.slot_mapping(t, start, end)):
            self.slots[slot] = tuple(seq[: p + 1]) if p < len(seq) else ("draft",)

    def verify(self, t: BlockTable, seq: list[int]) -> None:
        assert t.num_tokens == len(seq)
        for p, slot in enumerate(self.pool.slot_mapping(t, 0, t.num_tokens)):
            assert self.slots.get(slot) == tuple(seq[: p + 1]), f"wrong KV at position {p}"


def _admit(pool: BlockPool, kv: FakeKV, prompt: list[int]) -> BlockTable | None:
    _, hit = pool.match_prefix(prompt)
    t = BlockTable(blocks=[])
    try:
        pool.allocate(t, prompt, len(prompt) - hit)
    except NoFreeBlocks:
        assert t == BlockTable(blocks=[])  # all or nothing
        return None
    assert t.num_cached_tokens == hit
    kv.write(t, prompt, hit, len(prompt))
    pool.mark_written(t, prompt, len(prompt))
    return t


def _step(pool: BlockPool, kv: FakeKV, seq: list[int], t: BlockTable, n: int) -> None:
    """One speculative decode step: reserve 1 + n slots, write them, accept a part, truncate."""
    try:
        pool.allocate(t, seq, 1, num_lookahead=n)
    except NoFreeBlocks:
        return
    start, accept = t.num_tokens, 1 + n // 2
    seq += [(len(seq) * 7 + n) % 3 for _ in range(accept)]  # few distinct tokens: many prefix hits
    kv.write(t, seq, start, start + 1 + n)
    pool.mark_written(t, seq, start + accept)
    pool.truncate(t, t.num_tokens)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops_strategy, num_blocks=st.integers(4, 24), block_size=st.integers(1, 4))
def test_random_operations_keep_invariants(ops, num_blocks, block_size):
    pool = BlockPool(num_blocks, block_size)
    kv = FakeKV(pool)
    seqs: list[list[int]] = []
    tables: list[BlockTable] = []
    for op, k, n in ops:
        i = k % len(tables) if tables else -1
        if op == "admit" or i < 0:
            prompt = [(k + j) % 3 for j in range(n + 1)]
            t = _admit(pool, kv, prompt)
            if t is not None:
                seqs.append(prompt)
                tables.append(t)
        elif op == "step":
            _step(pool, kv, seqs[i], tables[i], n)
        elif op == "reserve":  # lookahead slots left reserved
            try:
                pool.allocate(tables[i], seqs[i], 0, num_lookahead=n)
            except NoFreeBlocks:
                pass
        elif op == "truncate":
            # Roll written tokens back, as far as the block re-opened for writing is this table's
            # alone (a table never writes into a block it shares).
            t, keep = tables[i], max(1, tables[i].num_tokens - n)
            if keep % block_size == 0 or pool._ref[t.blocks[keep // block_size]] == 1:
                pool.truncate(t, keep)
                del seqs[i][keep:]
        else:
            pool.free(tables.pop(i))
            seqs.pop(i)
        pool.check(tables)
        for seq, t in zip(seqs, tables):
            kv.verify(t, seq)
    for t in tables:
        pool.free(t)
    pool.check([])
    assert pool.num_free_blocks == num_blocks and pool.num_used_blocks == 0
