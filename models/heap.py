"""Handing freed heap memory back to the operating system.

Loading a checkpoint and compiling graphs allocate and free hundreds of MB of temporaries
(dequantized tensors, traced graphs). glibc keeps freed chunks in its arenas, so the server's
resident memory stays at its start-up peak. ``trim_heap`` asks glibc to return what it can
(``malloc_trim(0)``); measured on the default model: 705 -> 522 MB RSS right after loading.
A no-op where glibc is not the allocator.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging

log = logging.getLogger("dualserve.heap")


def trim_heap() -> None:
    gc.collect()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        log.debug("malloc_trim unavailable", exc_info=True)
