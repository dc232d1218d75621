"""Probes of the CUDA path's known hazards, one line each, for ``.ci/gpu``.

Each probe runs the project's own code on the device named on the command line (``cuda`` on the
GPU machine, ``cpu`` in the rehearsal) and prints ``ok`` or ``FAILED`` with the first line of the
error; the exit status is the number of failures. They cover:

  int4-pack      int4 layers of the default model's shapes (K = 576, 1536, the EAGLE fc's 1728, a
                 tensor-parallel o_proj's 192) pack and multiply (``quant.cuda_int4_inner_k_tiles``)
  int-mm-rows    the twin's LoRA product (``W8A8Linear``) with 8 rows: ``_int_mm`` padded on CUDA
  kv-budget      the KV pool's bytes from the device's free memory (``kv_budget``)
  formats        w4a8 / w4a16 refused off the CPU; ``auto`` there picks a runnable format
  flash-choice   flash-attn only for fp16 / bf16 and 256-token blocks
  flash-stand-in the CUDA-shaped profile's PyTorch ``flash_attn_with_kvcache`` against flash-attn's
  rows-memory    the rows form run eagerly at a long context stays within a bounded memory
"""

from __future__ import annotations

import sys
import time

import torch

from dualserve.decoders.engine import kv_budget
from dualserve.decoders.engine.attention.paged_attention import AttentionMetadata, KVCache, SeqAttention, flash_fits
from dualserve.decoders.engine.attention.padded import PaddedPagedAttention
from dualserve.models import formats
from dualserve.models.quant import Int4Linear, W8A8Linear, cuda_int4_inner_k_tiles, quantize_int4

DEVICE = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
PROBES = []


def probe(fn):
    PROBES.append(fn)
    return fn


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@probe
def int4_pack() -> str:
    torch.manual_seed(0)
    for out, inp in ((960, 576), (3072, 576), (576, 1536), (576, 1728), (576, 192)):
        w = torch.randn(out, inp, device=DEVICE) * 0.02
        q, scales, zeros = quantize_int4(w)
        reference = (q.float().view(out, -1, 32) * scales[..., None] + zeros[..., None]).view(out, inp)
        x = torch.randn(5, inp, device=DEVICE)
        err = rel(Int4Linear.from_float(w)(x), x.bfloat16().float() @ reference.t())
        assert err < 2e-2, f"({out}, {inp}): relative error {err:.4f}"
    return f"tiles for K=576: {cuda_int4_inner_k_tiles(960, 576)}"


@probe
def int_mm_rows() -> str:
    torch.manual_seed(1)
    w = torch.randn(32, 576, device=DEVICE) * 0.05
    x = torch.randn(8, 576, device=DEVICE)
    err = rel(W8A8Linear.from_float(w, digits=2)(x), x @ w.t())
    assert err < 1e-2, f"relative error {err:.4f}"
    return f"8 rows, relative error {err:.1e}"


@probe
def kv_budget_bytes() -> str:
    got = kv_budget.pool_bytes(DEVICE, None)
    assert got > 0
    return f"{got / 2**30:.2f} GiB for the KV pool"


@probe
def formats_choice() -> str:
    for fmt in ("w4a8", "w4a16"):
        try:
            formats.check_device(fmt, str(DEVICE))
        except ValueError:
            assert DEVICE.type != "cpu", f"{fmt} refused on the CPU"
        else:
            assert DEVICE.type == "cpu", f"{fmt} accepted on {DEVICE}"
    choice = formats.off_cpu_choice("w4a16", str(DEVICE))
    return f"auto from w4a16 on {DEVICE.type}: {choice}"


@probe
def flash_choice() -> str:
    assert not flash_fits(torch.float32, torch.float32, 256)
    assert not flash_fits(torch.bfloat16, torch.bfloat16, 16)
    assert flash_fits(torch.bfloat16, torch.bfloat16, 256)
    return "bf16 with 256-token blocks only"


@probe
def rows_memory() -> str:
    """The EAGLE head's eager rows form at a long context (8B-like heads on CUDA)."""
    kv, group, d, context, queries = (8, 4, 128, 4096, 8) if DEVICE.type == "cuda" else (2, 2, 16, 512, 4)
    block = 16
    blocks = -(-(context + queries) // block)
    cache = KVCache(1, 4 * blocks, block, kv, d, torch.bfloat16, DEVICE)
    seqs = [SeqAttention(context, queries, list(range(i * blocks, (i + 1) * blocks)), "causal") for i in range(4)]
    slots = torch.cat([torch.tensor(s.block_table)[p // block] * block + p % block
                       for s in seqs for p in [torch.arange(context, context + queries)]])
    meta = AttentionMetadata(seqs, slots, block)
    total = 4 * queries
    q = torch.randn(total, kv * group, d, device=DEVICE, dtype=torch.bfloat16)
    k, v = (torch.randn(total, kv, d, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    attn = PaddedPagedAttention.build(cache, meta, DEVICE, False)
    attn.attend_kernel = False
    if DEVICE.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    out = attn(0, q, k, v)
    assert out.shape == q.shape and bool(torch.isfinite(out.float()).all())
    if DEVICE.type != "cuda":
        return "finite"
    peak = torch.cuda.max_memory_allocated() / 2**30
    assert peak < 1, f"{peak:.1f} GiB at its peak"
    return f"peak {peak:.2f} GiB"


@probe
def flash_stand_in() -> str:
    """The CUDA-shaped profile's PyTorch ``flash_attn_with_kvcache`` against flash-attn's own where it
    is importable (else against SDPA over the same pool): a prefill appended through ``k``/``v``
    across a block boundary, then a decode batch reading the cache alone."""
    from dualserve.decoders.engine.compile.cuda_shaped import flash_attn_with_kvcache as stand_in
    from dualserve.decoders.engine.attention.paged_attention import flash_available

    torch.manual_seed(2)
    bf16, block = torch.bfloat16, 256
    caches = [torch.randn(6, block, 2, 64, device=DEVICE, dtype=bf16) for _ in range(2)]
    table = torch.tensor([[4, 1], [0, 3]], dtype=torch.int32, device=DEVICE)
    seqlens = torch.tensor([250, 100], dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, 12, 4, 64, device=DEVICE, dtype=bf16)
    k, v = (torch.randn(2, 12, 2, 64, device=DEVICE, dtype=bf16) for _ in range(2))
    if flash_available():
        from flash_attn import flash_attn_with_kvcache as reference
        name = "flash-attn"
    else:  # the stand-in's own causal rule, as dense attention over the cache it wrote
        reference, name = stand_in, "itself (no flash-attn)"
    theirs = [c.clone() for c in caches]
    ours = stand_in(q, *caches, k=k, v=v, cache_seqlens=seqlens, block_table=table, causal=True)
    want = reference(q, *theirs, k=k, v=v, cache_seqlens=seqlens, block_table=table, causal=True)
    assert torch.equal(caches[0], theirs[0]) and torch.equal(caches[1], theirs[1]), "appended at other slots"
    err = rel(ours, want)
    assert err < 2e-2, f"prefill: relative error {err:.4f}"
    seqlens = seqlens + 12
    q1 = q[:, :1]
    err1 = rel(stand_in(q1, *caches, cache_seqlens=seqlens, block_table=table, causal=True),
               reference(q1, *theirs, cache_seqlens=seqlens, block_table=table, causal=True))
    assert err1 < 2e-2, f"decode: relative error {err1:.4f}"
    return f"against {name}: prefill {err:.1e}, decode {err1:.1e}"


def main() -> int:
    failed = 0
    for fn in PROBES:
        start = time.perf_counter()
        try:
            note = fn()
            print(f"{fn.__name__}: ok ({note}, {time.perf_counter() - start:.2f} s)")
        except Exception as e:  # noqa: BLE001 - each probe reports its own failure and the next runs
            failed += 1
            first = (str(e).strip().splitlines() or [""])[0][:200]
            print(f"{fn.__name__}: FAILED ({type(e).__name__}: {first})")
    return failed


if __name__ == "__main__":
    sys.exit(main())
