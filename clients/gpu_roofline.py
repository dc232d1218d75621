"""Per-forward time of an 8B-class LLaDA-shaped model with random weights, against its roofline.

Run on a GPU as ``python -m dualserve.clients.gpu_roofline`` (``--tiny`` runs the same cases on
a toy shape, on any device, to check the script). The model is LLaDA-8B-Instruct's shape
(d_model 4096, 32 layers, 32 heads, MHA, SwiGLU 12288, vocab 126464) built on the meta device
and filled with random bf16 weights; forwards go through the serving path (``ModelRunner``,
paged KV in a block pool, the same ``ForwardItem``s the diffusion decoder builds).

Cases (one forward each, timed with CUDA events after warm-up):

- ``full``: a no-cache step over prompt + canvas (bidirectional), logits for one block;
- ``dual``: a dual-cache step: one block of queries over the cached prefix and suffix;
- ``dual-batch``: the same for ``--batch`` requests in one forward (ragged batch);
- ``ar-decode``: one causal token over the cached prefix (the memory-bound reference).

Roofline (Williams et al., CACM 2009): time >= max(FLOPs / peak matmul rate, bytes / memory
bandwidth). FLOPs = 2 x (matmul weights) x tokens + 2 x vocab x hidden x logit rows + 4 x
layers x hidden x (query tokens x keys) for attention; bytes = weights read once + cached keys
and values read + new keys and values written. Defaults are an H200 SXM's dense bf16 rate
(989 TFLOP/s) and HBM3e bandwidth (4.8 TB/s); pass ``--peak-tflops`` / ``--peak-gbps`` for others.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dualserve.decoders.engine.runner import ForwardItem, ModelRunner
from dualserve.models.config import ModelConfig
from dualserve.models.transformer import Transformer

LLADA_8B = ModelConfig(family="llada", vocab_size=126464, hidden_size=4096, num_layers=32, num_heads=32,
                       num_kv_heads=32, head_dim=128, intermediate_size=12288, rms_norm_eps=1e-5,
                       rope_theta=500000.0, mask_token_id=126336)
TOY = ModelConfig(family="llada", vocab_size=1024, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
                  head_dim=16, intermediate_size=128, mask_token_id=1000)


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    query: int        # new tokens per sequence
    context: int      # cached tokens per sequence
    logit_rows: int   # rows per sequence that go through the output head
    mask: str         # "bidirectional" (diffusion) or "causal" (AR)


def cases(prompt: int, canvas: int, block: int, batch: int) -> list[Case]:
    return [Case("full", 1, prompt + canvas, 0, block, "bidirectional"),
            Case("dual", 1, block, prompt + canvas - block, block, "bidirectional"),
            Case("dual-batch", batch, block, prompt + canvas - block, block, "bidirectional"),
            Case("ar-decode", 1, 1, prompt + canvas, 1, "causal")]


def random_model(config: ModelConfig, device: str, dtype: torch.dtype) -> Transformer:
    """Random weights straight on the device: N(0, 1/fan_in) matrices, unit norms."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = Transformer(config)
    finally:
        torch.set_default_dtype(default)
    model = model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    model.rotary.reset(device)
    return model.eval().requires_grad_(False)


def matmul_params(c: ModelConfig) -> int:
    """Weights multiplied by every token in the layers (the output head is counted per logit row)."""
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    return c.num_layers * per_layer


def roofline(c: ModelConfig, case: Case, bytes_per: int, peak_flops: float, peak_bw: float) -> dict:
    tokens = case.batch * case.query
    keys = case.context + case.query
    kv_width = 2 * c.num_layers * c.num_kv_heads * c.head_dim  # key + value elements per token
    flops = (2 * matmul_params(c) * tokens + 2 * c.vocab_size * c.hidden_size * case.batch * case.logit_rows
             + 4 * c.num_layers * c.num_heads * c.head_dim * case.batch * case.query * keys)
    weights = (matmul_params(c) + c.vocab_size * c.hidden_size) * bytes_per
    kv_bytes = case.batch * (case.context + case.query) * kv_width * bytes_per
    total = weights + kv_bytes
    t_compute, t_memory = flops / peak_flops, total / peak_bw
    return {"flops": flops, "bytes": total, "roofline_ms": 1e3 * max(t_compute, t_memory),
            "bound": "compute" if t_compute >= t_memory else "memory"}


def items_for(runner: ModelRunner, case: Case, block_size: int) -> list[ForwardItem]:
    """One ForwardItem per sequence; each owns consecutive blocks of the pool."""
    per_seq = -(-(case.context + case.query) // block_size)
    items = []
    for b in range(case.batch):
        table = list(range(b * per_seq, (b + 1) * per_seq))
        start = case.context
        slots = [table[p // block_size] * block_size + p % block_size for p in range(start, start + case.query)]
        ids = torch.randint(0, runner.config.vocab_size, (case.query,))
        items.append(ForwardItem(ids, range(start, start + case.query), case.context, table, slots, case.mask))
    return items


def time_case(runner: ModelRunner, case: Case, block_size: int, warmup: int, iters: int) -> float:
    """Mean milliseconds of one forward + the output head on ``logit_rows`` per sequence."""
    items = items_for(runner, case, block_size)
    rows = torch.cat([torch.arange(b * case.query + case.query - case.logit_rows, (b + 1) * case.query)
                      for b in range(case.batch)]).to(runner.device)

    def once() -> None:
        hidden, _ = runner.forward(items)
        runner.logits(hidden[rows])

    for _ in range(warmup):
        once()
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            once()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        once()
    return 1e3 * (time.perf_counter() - t0) / iters


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dualserve.clients.gpu_roofline", description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="toy shape on any device (checks the script)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--canvas", type=int, default=256)
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 matmul peak, TFLOP/s")
    p.add_argument("--peak-gbps", type=float, default=4800.0, help="memory bandwidth, GB/s")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = TOY if args.tiny else LLADA_8B
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    bytes_per = torch.finfo(dtype).bits // 8
    model = random_model(config, args.device, dtype)
    block_size = 16
    runs = cases(args.prompt, args.canvas, args.block, args.batch)
    seq_blocks = max(-(-(c.context + c.query) // block_size) * c.batch for c in runs)
    runner = ModelRunner(model, seq_blocks, block_size, device=args.device)
    results = []
    for case in runs:
        ms = time_case(runner, case, block_size, args.warmup, args.iters)
        roof = roofline(config, case, bytes_per, args.peak_tflops * 1e12, args.peak_gbps * 1e9)
        results.append({"case": case.name, "batch": case.batch, "query": case.query, "context": case.context,
                        "ms": round(ms, 3), "roofline_ms": round(roof["roofline_ms"], 3),
                        "of_roofline": round(roof["roofline_ms"] / ms, 3), "bound": roof["bound"],
                        "tflops": round(roof["flops"] / ms / 1e9, 2), "gbps": round(roof["bytes"] / ms / 1e6, 1)})
    cols = list(results[0])
    print(f"{'toy' if args.tiny else 'LLaDA-8B-shaped'} random weights, {dtype}, {args.device}")
    print("  ".join(f"{c:>12}" for c in cols))
    for r in results:
        print("  ".join(f"{str(r[c]):>12}" for c in cols))
    if args.json:
        Path(args.json).write_text(json.dumps({"device": args.device, "dtype": str(dtype), "results": results},
                                              indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
