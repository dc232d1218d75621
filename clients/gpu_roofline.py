"""Per-forward time of ar, EAGLE and diffusion steps on 8B-class random models, against the roofline.

Run on a GPU as ``python -m dualserve.clients.gpu_roofline`` (``--tiny`` runs every case on toy
shapes, on any device, in seconds: it checks the script). Models and the roofline are in
``roofline.py``: Llama-3.1-8B with a random EAGLE-3 head for ar and eagle, LLaDA-8B for diffusion,
bf16 on a GPU (fp32 on a CPU), built on the meta device and filled on the target device.

Every forward goes through the serving path: ``ModelRunner`` over a paged KV pool (blocks of 256
tokens on CUDA, as the server uses, so flash-attn's paged kernel runs where it is installed), with
the ``ForwardItem``s the decoders build. ``--steps compiled`` runs the same cases through the
runner's compiled step (``engine/compile/compiled.py``: torch.compile'd, paged attention inside the graph),
compiled on first use, as a server without a compile thread would; a step whose graph failed to
compile is reported as ``eager-fallback``. The runner captures no CUDA graphs, so none are timed.

Cases (one forward each, plus the output head on the rows the decoder needs; timed with CUDA
events after warm-up, so host work the GPU waits for counts):

- ``ar-decode-b1`` / ``-bN``: one causal token per sequence over ``--prompt`` cached tokens
  (the memory-bound reference), for 1 and ``--batch`` sequences;
- ``eagle-verify-N``: what ``EagleDecoder`` verifies: root + draft tree of N query tokens with a
  tree mask over the same context, capturing EAGLE-3's three auxiliary layers, and the output
  head on all N rows (the decoder asks for them one visited node at a time, which re-reads the
  head per node: a batched call is the floor);
- ``eagle-draft``: the head's own cost: ``draft_tree`` as the decoder calls it (the decoder's GPU or
  CPU tree), ``depth - 1`` head forwards of ``top_k`` nodes plus their draft logits, top-k and
  the Python between them, with ``--steps eager`` (the head is never compiled). Its roofline is
  those forwards' work. The head's catch-up forward and its feature projection (a few rows per
  step) are not timed;
- ``diffusion-full``: a no-cache step over prompt + canvas (bidirectional), logits for one block;
- ``diffusion-dual``: a dual-cache step: one block of queries over the cached prefix and suffix;
- ``diffusion-dual-bN``: the same for ``--batch`` requests in one forward (ragged batch).

Roofline defaults are an H200 SXM's dense bf16 rate (989 TFLOP/s) and HBM3e bandwidth (4.8 TB/s);
pass ``--peak-tflops`` / ``--peak-gbps`` for others. ``--json`` is rewritten after every case, so a
run cut short by a timeout still leaves what it measured. A case that raises gets an ``error`` row
and the others still run; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Sequence

import torch

from dualserve.decoders.eagle.decoder import CPU_TREE, GPU_TREE
from dualserve.decoders.eagle.head_graph import HeadGraph, draft_tree, fed_nodes
from dualserve.decoders.eagle.tree import DraftTree, TreeConfig
from dualserve.decoders.engine.attention.padded import ROWS_MAX, StepShape
from dualserve.decoders.engine.runner import ForwardItem, ModelRunner
from dualserve.models.config import ModelConfig

from .roofline import (EAGLE3_DRAFT_VOCAB_8B, LLADA_8B, LLAMA3_8B, TOY_DRAFT_VOCAB, TOY_LLADA, TOY_LLAMA, Shape,
                       Work, forward_work, random_eagle3_head, random_model, roofline_ms)

Kind = Literal["ar", "verify", "canvas"]
Step = Literal["eager", "compiled"]
Group = Literal["ar", "eagle", "diffusion"]


@dataclass(frozen=True)
class Case:
    name: str
    kind: Kind
    batch: int        # sequences in the forward
    query: int        # new tokens per sequence
    context: int      # cached tokens per sequence
    logit_rows: int   # last rows of each sequence that go through the output head


def target_cases(prompt: int, batch: int, trees: Sequence[int], groups: Sequence[Group]) -> list[Case]:
    out = []
    if "ar" in groups:
        out += [Case(f"ar-decode-b{b}", "ar", b, 1, prompt, 1) for b in dict.fromkeys((1, batch))]
    if "eagle" in groups:
        out += [Case(f"eagle-verify-{n}", "verify", 1, n, prompt, n) for n in trees]
    return out


def diffusion_cases(prompt: int, canvas: int, block: int, batch: int) -> list[Case]:
    return [Case("diffusion-full", "canvas", 1, prompt + canvas, 0, block),
            Case("diffusion-dual", "canvas", 1, block, prompt + canvas - block, block),
            Case(f"diffusion-dual-b{batch}", "canvas", batch, block, prompt + canvas - block, block)]


def blocks_needed(cases: Sequence[Case], block_size: int) -> int:
    return max(c.batch * -(-(c.context + c.query) // block_size) for c in cases)


def verify_tree(n: int) -> DraftTree:
    """A binary draft tree of n nodes (root included), parents before children."""
    return DraftTree(list(range(n)), [-1] + [(i - 1) // 2 for i in range(1, n)])


def items_for(case: Case, block_size: int, vocab: int) -> list[ForwardItem]:
    """One ForwardItem per sequence, as the decoders build them; each owns consecutive blocks of the pool."""
    per_seq = -(-(case.context + case.query) // block_size)
    start, end = case.context, case.context + case.query
    items = []
    for b in range(case.batch):
        table = list(range(b * per_seq, (b + 1) * per_seq))
        slots = [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
        ids = torch.randint(0, vocab, (case.query,))
        if case.kind == "verify":  # EagleDecoder._item: positions by tree depth, the tree's own mask
            tree = verify_tree(case.query)
            items.append(ForwardItem(ids, torch.tensor(tree.depths) + start, start, table, slots, tree.mask()))
        else:
            mask = "causal" if case.kind == "ar" else "bidirectional"
            items.append(ForwardItem(ids, range(start, end), case.context, table, slots, mask))
    return items


def forward_fn(runner: ModelRunner, case: Case, aux_layers: tuple[int, ...]) -> Callable[[], None]:
    """One step: the forward, then the output head on each sequence's last ``logit_rows`` rows."""
    items = items_for(case, runner.block_size, runner.config.vocab_size)
    rows = torch.cat([torch.arange((b + 1) * case.query - case.logit_rows, (b + 1) * case.query)
                      for b in range(case.batch)]).to(runner.device)

    def once() -> None:
        hidden, _ = runner.forward(items, aux_layers=aux_layers)
        runner.logits(hidden[rows])

    return once


def time_ms(once: Callable[[], None], device: torch.device, warmup: int, iters: int) -> float:
    """Mean milliseconds per call after ``warmup`` untimed calls."""
    for _ in range(warmup):
        once()
    if device.type == "cuda":
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


def sig(x: float) -> float:
    """Three significant figures: toy rooflines are nanoseconds, 8B ones milliseconds."""
    return float(f"{x:.3g}")


class Report:
    """Rows as they are measured: printed at once, and the JSON rewritten after each."""

    COLUMNS = ("case", "step", "batch", "tokens", "context", "ms", "tokens_per_s", "roofline_ms", "of_roofline",
               "bound")
    WIDTHS = (18, 14, 5, 6, 7, 9, 12, 11, 11, 7)

    def __init__(self, args: argparse.Namespace, meta: dict):
        self.args = args
        self.meta = meta
        self.rows: list[dict] = []

    def header(self, title: str) -> None:
        print(title, flush=True)
        print("  ".join(f"{c:>{w}}" for c, w in zip(self.COLUMNS, self.WIDTHS)), flush=True)

    def add(self, case: str, step: str, batch: int, tokens: int, context: int, ms: float, work: Work) -> None:
        roof, bound = roofline_ms(work, self.args.peak_tflops * 1e12, self.args.peak_gbps * 1e9)
        row = {"case": case, "step": step, "batch": batch, "tokens": tokens, "context": context,
               "ms": round(ms, 3), "tokens_per_s": round(1e3 * tokens / ms, 1), "roofline_ms": sig(roof),
               "of_roofline": sig(roof / ms), "bound": bound, "tflops": round(work.flops / ms / 1e9, 2),
               "gbps": round(work.bytes / ms / 1e6, 1)}
        self.rows.append(row)
        print("  ".join(f"{str(row[c]):>{w}}" for c, w in zip(self.COLUMNS, self.WIDTHS)), flush=True)
        self.write(complete=False)

    def error(self, case: str, step: str, exc: Exception) -> None:
        """A case that raised: its row says why, and the other cases still run."""
        message = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        self.rows.append({"case": case, "step": step, "error": message})
        print(f"{case:>18}  {step:>14}  error: {message}", flush=True)
        self.write(complete=False)

    @property
    def failed(self) -> bool:
        return any("error" in r for r in self.rows)

    def write(self, complete: bool) -> None:
        if self.args.json:
            Path(self.args.json).write_text(json.dumps({**self.meta, "complete": complete, "results": self.rows},
                                                       indent=2))


def step_label(runner: ModelRunner, step: Step, case: Case, aux: tuple[int, ...]) -> str:
    """"compiled" only if this step's graph really ran (a failed compile leaves eager in charge)."""
    if step == "eager":
        return "eager"
    key = (StepShape(case.query > ROWS_MAX), aux)
    return "compiled" if runner.compiled is not None and key in runner.compiled.ready else "eager-fallback"


def run_cases(runner: ModelRunner, cases: Sequence[Case], step: Step, report: Report, aux: tuple[int, ...],
              bytes_per: int) -> None:
    shape = Shape.of(runner.model)
    if step == "compiled" and runner.compiled is None:
        runner.compile()
    for case in cases:
        case_aux = aux if case.kind == "verify" else ()
        try:
            ms = time_ms(forward_fn(runner, case, case_aux), runner.device, report.args.warmup, report.args.iters)
        except Exception as exc:  # noqa: BLE001 - reported as the case's row
            report.error(case.name, step, exc)
            continue
        work = forward_work(shape, case.batch, case.query, case.context, case.logit_rows, bytes_per)
        report.add(case.name, step_label(runner, step, case, case_aux), case.batch, case.batch * case.query,
                   case.context, ms, work)


def run_draft(runner: ModelRunner, head, tree: TreeConfig, context: int, report: Report, bytes_per: int) -> None:
    """A tree as the decoder drafts it (``head_graph.draft_tree``, eager) from a root at position
    ``context``, the head attending over ``context`` cached slots."""
    c = head.config.layer
    spare = fed_nodes(tree)
    kv = runner.head_kv(head.config.num_layers, c.num_kv_heads, c.head_dim, spare)
    graph = HeadGraph(head, kv, runner.kv.num_blocks * runner.block_size, spare)
    slots = torch.arange(context, device=runner.device)  # (context,) blocks 0.. hold it, as in items_for
    last_hidden = torch.randn(c.hidden_size, device=runner.device, dtype=runner.dtype)  # (hidden,) at the root

    def once() -> None:
        with torch.inference_mode():
            logp = torch.log_softmax(head.logits(last_hidden[None])[0], -1)
            draft_tree(graph, 0, logp, last_hidden, slots, context, tree, tree.depth)

    try:
        ms = time_ms(once, runner.device, report.args.warmup, report.args.iters)
    except Exception as exc:  # noqa: BLE001 - reported as the case's row
        report.error("eagle-draft", "eager", exc)
        return
    shape, levels = Shape.of(head), tree.depth - 1
    work = (forward_work(shape, 1, tree.top_k, context, tree.top_k, bytes_per) * levels
            + Work(2 * shape.out_params, shape.out_params * bytes_per))  # the root's draft logits
    report.add("eagle-draft", "eager", 1, levels * tree.top_k, context, ms, work)


def build_runner(config: ModelConfig, cases: Sequence[Case], args: argparse.Namespace) -> ModelRunner:
    block_size = 256 if args.device.startswith("cuda") else 16  # the server's choice (server/cli.py)
    model = random_model(config, args.device, args.dtype)
    return ModelRunner(model, blocks_needed(cases, block_size), block_size, device=args.device)


def run_target(args: argparse.Namespace, report: Report) -> None:
    """ar and eagle cases on the Llama-shaped model (and its EAGLE-3 head)."""
    config, draft_vocab = (TOY_LLAMA, TOY_DRAFT_VOCAB) if args.tiny else (LLAMA3_8B, EAGLE3_DRAFT_VOCAB_8B)
    cases = target_cases(args.prompt, args.batch, args.trees, args.groups)
    runner = build_runner(config, cases, args)
    head = random_eagle3_head(runner.model, draft_vocab)
    report.header(f"{'toy Llama' if args.tiny else 'Llama-3.1-8B'}-shaped random weights, {args.dtype}, "
                  f"{args.device}, attention {runner.backend.__name__}, block {runner.block_size}")
    for step in args.steps:
        run_cases(runner, cases, step, report, head.config.aux_layers, args.bytes_per)
    if "eagle" in args.groups and "eager" in args.steps:  # the head always runs eagerly
        tree = GPU_TREE if runner.device.type == "cuda" else CPU_TREE
        run_draft(runner, head, tree, args.prompt, report, args.bytes_per)


def run_diffusion(args: argparse.Namespace, report: Report) -> None:
    cases = diffusion_cases(args.prompt, args.canvas, args.block, args.batch)
    runner = build_runner(TOY_LLADA if args.tiny else LLADA_8B, cases, args)
    report.header(f"{'toy LLaDA' if args.tiny else 'LLaDA-8B'}-shaped random weights, {args.dtype}, {args.device}")
    for step in args.steps:
        run_cases(runner, cases, step, report, (), args.bytes_per)


FULL = {"prompt": 256, "canvas": 256, "block": 32, "batch": 8, "warmup": 3, "iters": 10}
TINY = {"prompt": 24, "canvas": 16, "block": 8, "batch": 2, "warmup": 1, "iters": 2}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dualserve.clients.gpu_roofline", description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="toy shapes on any device (checks the script)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--groups", nargs="+", choices=("ar", "eagle", "diffusion"), default=["ar", "eagle", "diffusion"])
    p.add_argument("--steps", nargs="+", choices=("eager", "compiled"), default=["eager"],
                   help="eager forwards, the runner's compiled step, or both (compiles on first use)")
    for name, full in FULL.items():
        p.add_argument(f"--{name}", type=int, default=None, help=f"default {full} ({TINY[name]} with --tiny)")
    p.add_argument("--trees", type=int, nargs="+", default=[8, 16], help="EAGLE verify query tokens (root + tree)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 matmul peak, TFLOP/s")
    p.add_argument("--peak-gbps", type=float, default=4800.0, help="memory bandwidth, GB/s")
    p.add_argument("--json", default=None, help="write every row here (rewritten after each case)")
    args = p.parse_args(argv)
    for name, value in (TINY if args.tiny else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.block > args.canvas:
        p.error("--block must not exceed --canvas")
    args.dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    args.bytes_per = torch.finfo(args.dtype).bits // 8
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    if args.tiny and args.device == "cpu":
        torch.set_num_threads(1)  # toy matmuls: handing work to a second thread costs more than it saves
    try:
        report = run(args)
    finally:
        torch.set_num_threads(threads)
    return 1 if report.failed else 0


def run(args: argparse.Namespace) -> Report:
    device = torch.device(args.device)
    meta = {"device": args.device, "dtype": str(args.dtype), "tiny": args.tiny, "steps": args.steps,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "peak_tflops": args.peak_tflops, "peak_gbps": args.peak_gbps, "prompt": args.prompt,
            "canvas": args.canvas, "block": args.block, "batch": args.batch, "torch": torch.__version__}
    report = Report(args, meta)
    report.write(complete=False)  # a run cut off before its first row still leaves its settings
    if {"ar", "eagle"} & set(args.groups):
        run_target(args, report)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the first model is gone: give its memory back before the next
    if "diffusion" in args.groups:
        run_diffusion(args, report)
    report.write(complete=True)
    return report


if __name__ == "__main__":
    from dualserve.models.errors import one_line

    raise SystemExit(one_line(main))
