"""A loaded model's weights on transparent huge pages.

A decode step streams every weight once: the default model's ~100 MB a token, through 25,000
pages of 4 KB, each a TLB miss and a page walk, and the hardware prefetchers stop at every page's
end. On 2 MB pages the same stream crosses 50. Linux backs anonymous memory with huge pages
where a region asks for them (``madvise(MADV_HUGEPAGE)``, the default ``madvise`` mode of
``/sys/kernel/mm/transparent_hugepage/enabled``) or always (``always``). PyTorch's allocator asks
for nothing (a layer's tensors are each far below 2 MB), so ``place_on_huge_pages`` moves a
model's weights into one anonymous mapping that asks, 2 MB-aligned, storage by storage: each
weight keeps its own storage (a saved module saves only its own bytes), its values, its strides
and its views, and the old storage is freed as soon as it is moved, so a load's peak grows by
one storage, not by the model.

Measured on a 2-core AMD EPYC (Zen 4), the default model's compiled decode forward and head, the
same process alternating the two placements three times (ad-hoc probe, median of 300): 5.19-5.45
ms on 4 KB pages, 4.81-4.93 on huge pages (docs/benchmarks.md).

Only on Linux, for tensors in CPU memory; elsewhere, or where the host's mode is ``never``, the
model is left as it is.
"""

from __future__ import annotations

import logging
import mmap
from pathlib import Path

import torch

log = logging.getLogger("dualserve.huge_pages")

HUGE = 2 << 20
ALIGN = 64
MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MIN_BYTES = 8 << 20  # below this a model's weights span too few huge pages to matter


def host_mode() -> str | None:
    """The host's transparent huge page mode (``always``, ``madvise`` or ``never``), or None where
    it has none (not Linux, or no THP)."""
    try:
        text = MODE.read_text()
    except OSError:
        return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The model's parameters and buffers in CPU memory, each tensor object once."""
    seen: set[int] = set()
    out = []
    for t in [*model.parameters(), *model.buffers()]:
        if t is None or id(t) in seen or t.device.type != "cpu" or t.is_sparse:
            continue
        seen.add(id(t))
        out.append(t)
    return out


def place_on_huge_pages(model: torch.nn.Module, min_bytes: int = MIN_BYTES) -> int:
    """Move ``model``'s CPU weights into memory advised for transparent huge pages (see the
    module docstring). Returns the bytes moved (0 where nothing was: no THP, or less than
    ``min_bytes`` of weights). The values and every tensor object stay the same; a graph or a
    list already holding the tensors sees them moved."""
    if host_mode() not in ("always", "madvise") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return 0
    by_storage: dict[int, list[torch.Tensor]] = {}
    sizes: dict[int, int] = {}
    for t in _weights(model):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0:
            continue
        by_storage.setdefault(key, []).append(t)
        sizes[key] = storage.nbytes()
    total = sum((n + ALIGN - 1) // ALIGN * ALIGN for n in sizes.values())
    if total < min_bytes:
        return 0
    # Whole huge pages from a 2 MB boundary on: the mapping is one page longer than they need, so
    # wherever it starts they fit (untouched, the spare bytes cost nothing).
    span = (total + HUGE - 1) // HUGE * HUGE
    arena = mmap.mmap(-1, span + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = (-_address(arena)) % HUGE
    try:
        arena.madvise(mmap.MADV_HUGEPAGE, start, span)
    except OSError as e:  # a kernel without THP for anonymous memory
        log.debug("madvise(MADV_HUGEPAGE) refused: %s", e)
        arena.close()
        return 0
    offset = start
    with torch.no_grad():
        for key, tensors in by_storage.items():
            n = sizes[key]
            old = torch.empty(0, dtype=torch.uint8).set_(tensors[0].untyped_storage())
            new = torch.frombuffer(arena, dtype=torch.uint8, count=n, offset=offset)
            new.copy_(old)
            storage = new.untyped_storage()
            for t in tensors:
                t.set_(storage, t.storage_offset(), t.size(), t.stride())
            del old, new
            offset += (n + ALIGN - 1) // ALIGN * ALIGN
    return total


def _address(arena: mmap.mmap) -> int:
    """The mapping's first byte's address."""
    return torch.frombuffer(arena, dtype=torch.uint8, count=1).data_ptr()
