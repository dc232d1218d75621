"""How much memory the KV block pool gets, by device.

The pool is sized once, after the weights have loaded (``deployment``), from what the device has:

- on the CPU, from the host's memory: 1/64 of it, between 0.25 and 1 GB (the pool shares the
  machine with the weights, the compile thread's builds and whatever else runs there);
- on CUDA, from the device's free memory as ``torch.cuda.mem_get_info`` reports it once the weights
  are on it: a fraction ``utilization`` of it (vLLM's ``gpu_memory_utilization``, 0.9 by default,
  leaving the rest to other processes and to the allocator's fragmentation), less a headroom for
  what the steps allocate beside the pool (activations, logits, captured CUDA graphs' memory pool,
  cuBLAS workspaces).

An explicit size (``--kv-memory-gb``) wins on every device. Everything here is a pure function of
its arguments and of ``torch.cuda.mem_get_info``, so the CUDA rule is tested on the CPU with that
one call replaced.
"""

from __future__ import annotations

import os

import torch

GPU_MEMORY_UTILIZATION = 0.9      # the share of the device's free memory the pool may take (vLLM's default)
ACTIVATION_HEADROOM = 2 * 2**30   # bytes kept free for a step's activations, graphs and workspaces
HOST_SHARE = 64                   # the CPU pool: this fraction of the host's memory ...
HOST_MIN_GB, HOST_MAX_GB = 0.25, 1.0  # ... within these bounds
MIN_BLOCKS = 16                   # a pool smaller than this serves nothing useful


def host_memory_gb() -> float:
    """This machine's memory in GB, or 0 where it cannot be asked (no ``os.sysconf`` on Windows)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (AttributeError, ValueError, OSError):
        return 0.0


def host_pool_gb(total_gb: float) -> float:
    """The CPU pool for a host of ``total_gb``: 1/64 of it, between 0.25 and 1 GB."""
    return min(HOST_MAX_GB, max(HOST_MIN_GB, total_gb / HOST_SHARE))


def device_pool_bytes(device: torch.device | str, utilization: float = GPU_MEMORY_UTILIZATION,
                      headroom: int = ACTIVATION_HEADROOM) -> int:
    """The CUDA pool: ``utilization`` of the device's free memory, less ``headroom``; call it once
    the weights are on the device. 0 where that leaves nothing."""
    if not 0 < utilization <= 1:
        raise ValueError(f"the GPU memory utilization is a fraction in (0, 1], not {utilization}")
    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return max(0, int(free * utilization) - headroom)


def pool_bytes(device: torch.device | str, memory_gb: float | None,
               utilization: float = GPU_MEMORY_UTILIZATION, headroom: int = ACTIVATION_HEADROOM) -> int:
    """The pool's bytes on ``device``: ``memory_gb`` where given (``--kv-memory-gb``), else the
    device's rule (module docstring)."""
    if memory_gb is not None:
        return int(memory_gb * 2**30)
    if torch.device(device).type == "cuda":
        return device_pool_bytes(device, utilization, headroom)
    return int(host_pool_gb(host_memory_gb()) * 2**30)


def pool_blocks(budget: int, bytes_per_block: int) -> int:
    """Blocks of ``bytes_per_block`` (every loaded model's KV of one block) in ``budget`` bytes, at
    least ``MIN_BLOCKS``."""
    return max(MIN_BLOCKS, budget // max(bytes_per_block, 1))
