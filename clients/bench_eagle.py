"""Single-stream speed of the EAGLE decoder against plain AR, in one process, prompt by prompt.

Run as ``python -m dualserve.clients.bench_eagle``. One in-process engine serves both
decoders from the same weights and block pool; for each prompt of ``prompts/bench.jsonl``
(sent as one user message through the chat template) it generates greedily with ``ar`` and
with ``eagle`` (alternating which goes first, so slow drift on a shared machine hits both
alike) and records:

- tok/s: completion tokens / wall time of the request (prefill included, as a client sees it);
- acceptance length: tokens emitted per target forward in EAGLE steps (accepted drafts + the
  target's own bonus token; EAGLE paper's tau), and the draft / verify time split;
- whether the greedy outputs are identical token for token (they must be).

With ``--llama-cpp`` the same token ids also go through llama.cpp (``llama_cpp`` package, if
installed) on the GGUF file, for a side-by-side tok/s column. Prefix caching is off so every
run computes its whole prompt.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch

from dualserve.clients.bench import DEFAULT_PROMPTS, load_prompts


@dataclass
class Row:
    id: str
    kind: str
    tokens_ar: int
    tokens_eagle: int
    tps_ar: float
    tps_eagle: float
    accept_length: float
    draft_s: float
    verify_s: float
    identical: bool
    tps_llama_cpp: float | None = None

    @property
    def speedup(self) -> float:
        return self.tps_eagle / self.tps_ar if self.tps_ar else 0.0


def generate(engine, model: str, decoder: str, ids: list[int], max_tokens: int) -> tuple[list[int], float, dict]:
    from dualserve.decoders.engine.sampling import SamplingParams

    deltas = []
    start = time.perf_counter()
    engine.submit(model, decoder, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                  lambda _, d: deltas.append(d))
    engine.run_until_idle()
    elapsed = time.perf_counter() - start
    return [t for d in deltas for t in d.token_ids], elapsed, deltas[-1].stats or {}


def llama_cpp_runner(gguf: Path, threads: int):
    """A function ids -> (tokens, seconds) through llama.cpp, or None when it is not installed."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(gguf), n_ctx=2048, n_threads=threads or None, verbose=False)

    def run(ids: list[int], max_tokens: int) -> tuple[int, float]:
        llm.reset()
        start = time.perf_counter()
        out = llm.create_completion(ids, max_tokens=max_tokens, temperature=0.0)
        return out["usage"]["completion_tokens"], time.perf_counter() - start

    return run


def bench(args: argparse.Namespace) -> list[Row]:
    from dualserve.decoders.deployment import PoolSpec, build_deployment
    from dualserve.decoders.eagle.decoder import eagle_decoder
    from dualserve.decoders.eagle.tree import TreeConfig
    from dualserve.decoders.engine.engine import EngineConfig
    from dualserve.models.hub import default_cache_dir, resolve_model
    from dualserve.models.loader import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    cache = default_cache_dir(args.cache_dir)
    name, path = resolve_model(args.model, cache)
    loaded = load_model(path, name=name, cache_dir=cache)
    dep = build_deployment([loaded], EngineConfig(enable_prefix_caching=False), PoolSpec(num_blocks=args.num_blocks))
    engine = dep.engine
    tree = TreeConfig(args.depth, args.top_k, args.num_nodes) if args.depth else None
    decoder = eagle_decoder(loaded, dep.runners[name], engine.pool, args.head, tree)
    if decoder is None:
        raise SystemExit(f"no EAGLE head for {name}: pass --head")
    if "eagle" not in engine.decoders_for(name):
        engine.add_decoder(name, decoder, loaded.tokenizer)
    llama = llama_cpp_runner(path, args.threads) if args.llama_cpp and path.suffix == ".gguf" else None
    tok = loaded.tokenizer
    prompts = load_prompts(args.prompts)[: args.limit or None]
    rows: list[Row] = []
    for i, p in enumerate([None] + prompts):  # the first (None) run is an unmeasured warm-up
        text = tok.apply_chat_template([{"role": "user", "content": p.prompt if p else "Hello!"}],
                                       add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
        order = ("ar", "eagle") if i % 2 else ("eagle", "ar")
        runs = {d: generate(engine, name, d, ids, args.max_tokens if p else 8) for d in order}
        if p is None:
            continue
        (ar_ids, ar_s, _), (ea_ids, ea_s, stats) = runs["ar"], runs["eagle"]
        row = Row(p.id, p.kind, len(ar_ids), len(ea_ids), len(ar_ids) / ar_s, len(ea_ids) / ea_s,
                  stats.get("mean_accept_length", 0.0), stats.get("draft_seconds", 0.0),
                  stats.get("verify_seconds", 0.0), ar_ids == ea_ids)
        if llama:
            n, s = llama(ids, args.max_tokens)
            row.tps_llama_cpp = n / s
        rows.append(row)
        print(f"{row.id:<22} ar {row.tps_ar:6.1f} tok/s  eagle {row.tps_eagle:6.1f} tok/s  "
              f"x{row.speedup:4.2f}  tau {row.accept_length:4.2f}  identical={row.identical}",
              file=sys.stderr, flush=True)
    return rows


def summary(rows: Sequence[Row]) -> dict:
    tokens_ar = sum(r.tokens_ar for r in rows)
    tokens_eagle = sum(r.tokens_eagle for r in rows)
    secs_ar = sum(r.tokens_ar / r.tps_ar for r in rows)
    secs_eagle = sum(r.tokens_eagle / r.tps_eagle for r in rows)
    out = {
        "prompts": len(rows),
        "identical": sum(r.identical for r in rows),
        "tps_ar": tokens_ar / secs_ar,
        "tps_eagle": tokens_eagle / secs_eagle,
        "speedup": (tokens_eagle / secs_eagle) / (tokens_ar / secs_ar),
        "median_speedup": statistics.median(r.speedup for r in rows),
        "mean_accept_length": statistics.mean(r.accept_length for r in rows),
        "draft_share": sum(r.draft_s for r in rows) / max(1e-9, sum(r.draft_s + r.verify_s for r in rows)),
    }
    llama = [r for r in rows if r.tps_llama_cpp]
    if llama:
        out["tps_llama_cpp"] = statistics.mean(r.tps_llama_cpp for r in llama)
    return out


def print_table(rows: Sequence[Row], s: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="EAGLE vs plain AR, single stream, greedy")
    for col in ("prompt", "kind", "AR tok/s", "EAGLE tok/s", "speedup", "accept len", "draft s", "verify s",
                "identical") + (("llama.cpp tok/s",) if "tps_llama_cpp" in s else ()):
        table.add_column(col, justify="left" if col in ("prompt", "kind") else "right")
    for r in rows:
        cells = [r.id, r.kind, f"{r.tps_ar:.1f}", f"{r.tps_eagle:.1f}", f"{r.speedup:.2f}x",
                 f"{r.accept_length:.2f}", f"{r.draft_s:.2f}", f"{r.verify_s:.2f}", "yes" if r.identical else "NO"]
        if "tps_llama_cpp" in s:
            cells.append(f"{r.tps_llama_cpp:.1f}" if r.tps_llama_cpp else "-")
        table.add_row(*cells)
    console = Console(width=max(Console().width, 140))
    console.print(table)
    line = (f"overall: AR {s['tps_ar']:.1f} tok/s, EAGLE {s['tps_eagle']:.1f} tok/s, speedup {s['speedup']:.2f}x "
            f"(median {s['median_speedup']:.2f}x); mean acceptance length {s['mean_accept_length']:.2f}; "
            f"draft share of EAGLE time {s['draft_share']:.0%}; identical {s['identical']}/{s['prompts']}")
    if "tps_llama_cpp" in s:
        line += f"; llama.cpp {s['tps_llama_cpp']:.1f} tok/s"
    console.print(line)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dualserve.clients.bench_eagle", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="target (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--head", default=None, help="EAGLE head directory (default: the bundled one for the model)")
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    p.add_argument("--limit", type=int, default=0, help="first N prompts only")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--depth", type=int, default=0, help="tree depth (0: the decoder's default tree)")
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--num-nodes", type=int, default=10)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--llama-cpp", action="store_true", help="also time llama.cpp on the GGUF file")
    p.add_argument("--json", default=None, help="write rows and summary here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rows = bench(args)
    s = summary(rows)
    print_table(rows, s)
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": s, "rows": [asdict(r) for r in rows]}, indent=2))
    return 0 if s["identical"] == s["prompts"] else 1


if __name__ == "__main__":
    sys.exit(main())
