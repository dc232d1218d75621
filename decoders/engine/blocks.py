"""The one paged KV block pool that every decoder draws from.

Plain Python over integers: the pool hands out physical block ids, keeps a
reference count per block and an automatic prefix cache; it never touches a
tensor (the runner owns the KV tensors and turns block tables and slot ids into
indices). One request owns one `BlockTable`.

Design, after nano-vllm (`nanovllm/engine/block_manager.py`) and vLLM v1
(`vllm/v1/core/kv_cache_manager.py`, `block_pool.py`):

- Every block is in exactly one state: *free* (no content worth keeping),
  *in use* (reference count > 0) or *cached-evictable* (reference count 0 but
  holding the KV of a full, hashed block that a later request may reuse).
- A full, written block is keyed by a chained hash,
  ``hash((parent_hash, tuple(block_tokens)))``, so equal tokens at a different
  position (after a different prefix) never match.
- New blocks come from the free list first; only then is the least recently
  used cached block evicted. Tables are freed tail first, so a request's last
  blocks are evicted before its (more widely shared) first ones.
- Reserving and writing are separate: `allocate` reserves slots (possibly
  extra lookahead slots for speculative drafts), `mark_written` records which KV
  is written and publishes newly full blocks, `truncate` gives back what was not
  accepted. ("Commit" is reserved for tokens a request emits: `Request.commit`.)
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


class NoFreeBlocks(Exception):
    """The pool cannot supply the blocks asked for; nothing was changed."""


@dataclass
class BlockTable:
    """The physical blocks of one sequence, in order. Owned by its request."""

    blocks: list[int] = field(default_factory=list)
    # Tokens whose KV is written (set by BlockPool.mark_written/truncate).
    num_tokens: int = 0
    # Prefix tokens found in the prefix cache at admission (set by BlockPool.allocate).
    num_cached_tokens: int = 0
    # Chained hashes of the written full blocks, in order (kept by BlockPool).
    block_hashes: list[int] = field(default_factory=list, repr=False)
    # Root of the hash chain: whose KV tensors the blocks hold. Models that share the pool
    # keep separate KV tensors, so the same tokens must never hit another model's blocks.
    namespace: str | None = None


@dataclass
class PrefixCacheStats:
    """Counters since start-up; `queries` and `hits` count tokens."""

    queries: int = 0
    hits: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def slot_of(block_table, pos, block_size: int):
    """Flat KV slot of position ``pos``: ``block_id * block_size + offset``.

    The one place this arithmetic lives. It takes Python ints (``block_table`` a list) or
    tensors (``block_table`` and ``pos`` long tensors) alike."""
    return block_table[pos // block_size] * block_size + pos % block_size


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockPool:
    """Reference-counted KV blocks with an LRU prefix cache of full blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.stats = PrefixCacheStats()
        self._ref = [0] * num_blocks
        # Blocks with reference count 0 and nothing cached; taken from the left.
        self._free: deque[int] = deque(range(num_blocks))
        # Blocks with reference count 0 that hold a cached full block; oldest first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # Prefix cache: chained hash -> block, and back. A block's own tokens are
        # kept too, because Python's hash is not collision resistant: a hit is
        # confirmed against them, as nano-vllm does.
        self._cached: dict[int, int] = {}
        self._block_hash: list[int | None] = [None] * num_blocks
        self._block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        # The namespace (KV owner) of each cached block's hash chain, so that a model's entries can
        # be dropped when its KV tensors go away (``drop_namespaces``).
        self._block_namespace: list[str | None] = [None] * num_blocks

    # ---- occupancy ----------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: free plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    # ---- prefix cache ---------------------------------------------------------------

    def _block_key(self, parent_hash: int | str | None, tokens: tuple[int, ...]) -> int:
        return hash((parent_hash, tokens))

    def _match(self, token_ids: Sequence[int], namespace: str | None = None) -> tuple[list[int], list[int]]:
        """Cached blocks (and their hashes) for the longest cached full-block prefix."""
        if not self.enable_prefix_caching:
            return [], []
        bs = self.block_size
        # At least one token must be computed to get logits for the next one
        # (vLLM: get_computed_blocks caps the hit at num_tokens - 1).
        max_blocks = (len(token_ids) - 1) // bs
        blocks: list[int] = []
        hashes: list[int] = []
        parent: int | str | None = namespace
        for i in range(max_blocks):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = self._block_key(parent, tokens)
            block = self._cached.get(h)
            if block is None or self._block_tokens[block] != tokens:
                break
            blocks.append(block)
            hashes.append(h)
            parent = h
        return blocks, hashes

    def match_prefix(self, token_ids: Sequence[int], namespace: str | None = None) -> tuple[list[int], int]:
        """(block ids, tokens covered) of the longest cached prefix; no side effects."""
        blocks, _ = self._match(token_ids, namespace)
        return blocks, len(blocks) * self.block_size

    def computed_tokens(self, table: BlockTable, token_ids: Sequence[int], use_prefix_cache: bool = True) -> int:
        """Tokens whose KV needs no computing: the table's written tokens or, for an empty table,
        the prefix-cache hit ``allocate`` would take. No side effects (decoders' ``plan`` use it)."""
        if table.blocks or not use_prefix_cache:
            return table.num_tokens
        return self.match_prefix(token_ids, table.namespace)[1]

    def _uncache(self, block: int) -> None:
        h = self._block_hash[block]
        if h is not None:
            del self._cached[h]
            self._block_hash[block] = None
            self._block_tokens[block] = None
            self._block_namespace[block] = None

    # ---- single blocks --------------------------------------------------------------

    def _take_block(self) -> int:
        """One block with reference count 1; the caller has checked there is one."""
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            self._uncache(block)
            self.stats.evictions += 1
        self._ref[block] = 1
        return block

    def _release(self, block: int) -> None:
        self._ref[block] -= 1
        if self._ref[block] == 0:
            if self._block_hash[block] is not None:
                self._evictable[block] = None  # most recently used end
            else:
                self._free.append(block)

    # ---- tables ---------------------------------------------------------------------

    def _plan(
        self, table: BlockTable, token_ids: Sequence[int], num_new_tokens: int, num_lookahead: int,
        use_prefix_cache: bool = True,
    ) -> tuple[list[int], list[int], int, int]:
        """(hit blocks, hit hashes, new blocks needed, blocks available for them)."""
        hit_blocks, hit_hashes = self._match(token_ids, table.namespace) if not table.blocks and use_prefix_cache else ([], [])
        num_tokens = table.num_tokens if table.blocks else len(hit_blocks) * self.block_size
        have = len(table.blocks) + len(hit_blocks)
        need = max(0, _cdiv(num_tokens + num_new_tokens + num_lookahead, self.block_size) - have)
        # A hit on an evictable block takes it out of the free count.
        available = self.num_free_blocks - sum(1 for b in hit_blocks if self._ref[b] == 0)
        return hit_blocks, hit_hashes, need, available

    def allocate(
        self, table: BlockTable, token_ids: Sequence[int], num_new_tokens: int, num_lookahead: int = 0,
        *, use_prefix_cache: bool = True,
    ) -> None:
        """Reserve slots for `num_new_tokens` (+ `num_lookahead`) after table.num_tokens.

        An empty table (new or preempted request) first takes its prefix-cache
        hit, which sets num_cached_tokens and num_tokens; callers size
        `num_new_tokens` with `match_prefix` beforehand. `use_prefix_cache=False`
        skips that lookup (a request that needs logits over its whole prompt);
        its full blocks are still published by `mark_written`. `token_ids` are all
        known tokens of the sequence. All or nothing: raises NoFreeBlocks and
        changes nothing when the blocks are not there.
        """
        hit_blocks, hit_hashes, need, available = self._plan(
            table, token_ids, num_new_tokens, num_lookahead, use_prefix_cache)
        if need > available:
            raise NoFreeBlocks(f"need {need} blocks, {available} available")
        if not table.blocks:
            for block in hit_blocks:
                if self._ref[block] == 0:
                    del self._evictable[block]
                self._ref[block] += 1
            table.blocks = list(hit_blocks)
            table.block_hashes = list(hit_hashes)
            table.num_tokens = table.num_cached_tokens = len(hit_blocks) * self.block_size
            if self.enable_prefix_caching and use_prefix_cache:
                self.stats.queries += len(token_ids)
                self.stats.hits += table.num_cached_tokens
        table.blocks.extend(self._take_block() for _ in range(need))

    def slot_mapping(self, table: BlockTable, start: int, end: int) -> list[int]:
        """Flat KV slot ids (block_id * block_size + offset) of positions [start, end)."""
        bs = self.block_size
        if not 0 <= start <= end <= len(table.blocks) * bs:
            raise IndexError(f"positions [{start}, {end}) outside {len(table.blocks)} blocks")
        return [slot_of(table.blocks, p, bs) for p in range(start, end)]

    def mark_written(self, table: BlockTable, token_ids: Sequence[int], num_tokens: int) -> None:
        """KV of positions [0, num_tokens) is written; publish newly full blocks."""
        if not table.num_tokens <= num_tokens <= min(len(token_ids), len(table.blocks) * self.block_size):
            raise ValueError(f"cannot mark {num_tokens} tokens written (table has {table.num_tokens})")
        table.num_tokens = num_tokens
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(table.block_hashes), num_tokens // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = table.block_hashes[-1] if table.block_hashes else table.namespace
            h = self._block_key(parent, tokens)
            table.block_hashes.append(h)
            block = table.blocks[i]
            # A block re-opened by truncate while shared kept its old entry; once it is
            # written again under new content, that entry is stale.
            if self._block_hash[block] not in (None, h):
                self._uncache(block)
            # First writer wins: a duplicate block stays uncached and is freed normally.
            if h not in self._cached and self._block_hash[block] is None:
                self._cached[h] = block
                self._block_hash[block] = h
                self._block_tokens[block] = tokens
                self._block_namespace[block] = table.namespace

    def truncate(self, table: BlockTable, num_tokens: int) -> None:
        """Release blocks beyond what num_tokens needs; lower num_tokens to it if larger."""
        keep = _cdiv(num_tokens, self.block_size)
        for block in reversed(table.blocks[keep:]):
            self._release(block)
        del table.blocks[keep:]
        if num_tokens >= table.num_tokens:
            return
        table.num_tokens = num_tokens
        table.num_cached_tokens = min(table.num_cached_tokens, num_tokens)
        del table.block_hashes[num_tokens // self.block_size :]
        # The last kept block is partial again and will be overwritten: if only
        # this table holds it, its cache entry would go stale, so drop it. A
        # shared one keeps its entry (and must not be written by this table).
        if num_tokens % self.block_size and self._ref[table.blocks[-1]] == 1:
            self._uncache(table.blocks[-1])

    def free(self, table: BlockTable) -> None:
        """Drop the table's references, tail first, and leave it empty."""
        for block in reversed(table.blocks):
            self._release(block)
        table.blocks = []
        table.block_hashes = []
        table.num_tokens = table.num_cached_tokens = 0

    def drop_namespaces(self, namespaces: Iterable[str]) -> int:
        """Forget the cached blocks of ``namespaces`` (a model whose KV tensors are being freed):
        an idle one goes back to the free list, one still held only loses its cache entry. A later
        owner under the same name must never hit the old owner's blocks. Returns the blocks dropped."""
        names = set(namespaces)
        dropped = 0
        for block, namespace in enumerate(self._block_namespace):
            if namespace is None or namespace not in names:
                continue
            self._uncache(block)
            dropped += 1
            if self._ref[block] == 0:
                del self._evictable[block]
                self._free.append(block)
        return dropped

    # ---- debugging ------------------------------------------------------------------

    def check(self, tables: Iterable[BlockTable] | None = None) -> None:
        """Assert the pool's invariants; with `tables` (all live ones) also the refcounts."""
        free, evictable = set(self._free), set(self._evictable)
        used = {b for b in range(self.num_blocks) if self._ref[b] > 0}
        assert len(free) == len(self._free), "a block is twice in the free list"
        assert not (free & evictable) and not (free & used) and not (evictable & used)
        assert len(free) + len(evictable) + len(used) == self.num_blocks, "a block is lost"
        assert all(self._ref[b] == 0 and self._block_hash[b] is None for b in free)
        assert all(self._ref[b] == 0 and self._block_hash[b] is not None for b in evictable)
        assert all(self._block_hash[b] == h for h, b in self._cached.items())
        assert sum(h is not None for h in self._block_hash) == len(self._cached)
        if tables is None:
            return
        refs = [0] * self.num_blocks
        for t in tables:
            assert len(set(t.blocks)) == len(t.blocks), "a table holds a block twice"
            assert t.num_cached_tokens <= t.num_tokens <= len(t.blocks) * self.block_size
            assert len(t.block_hashes) <= t.num_tokens // self.block_size
            for block, h in zip(t.blocks, t.block_hashes):
                assert self._block_hash[block] in (None, h), "a table block cached under another hash"
            for block in t.blocks:
                refs[block] += 1
        assert refs == self._ref, "reference counts differ from the tables holding the blocks"
