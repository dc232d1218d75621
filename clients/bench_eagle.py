"""Single-stream speed of speculative decoding against plain AR, by draft source, in one process.

Run as ``python -m dualserve.clients.bench_eagle``. One in-process engine serves ``ar`` and
``eagle`` from the same weights and block pool. For each prompt of each prompt set (by default
the held-out chat prompts, ``prompts/bench.jsonl``, and the held-out agentic set,
``prompts/agentic.jsonl``: JSON extraction from given text, code edits that reproduce most of
their input, multi-turn tool calls) it generates greedily in each mode:

- ``ar``: plain autoregressive decoding;
- ``head``: ``eagle`` drafting with the EAGLE head alone (request field ``draft: "head"``);
- ``suffix``: ``eagle`` drafting from suffix lookup alone (``draft: "suffix"``);
- ``both``: the head and suffix lookup in one tree (``draft: "both"``, the default);
- ``block``: ``eagle`` drafting with a DFlash block-diffusion drafter alone (``draft: "block"``;
  ``--dflash DIR`` loads one beside the head);
- ``both-no-datastore``: ``both`` with suffix lookup's datastore of answers set aside
  (``--datastore``), so its gain is measured in the same run.

Modes take turns going first, so slow drift on a shared machine hits all alike. Reported per set
and mode: tok/s (completion tokens / request wall time, prefill included), the ratio to ``ar``,
the decode rate after the first token and its ratio (the prefill is the same work in every mode,
and on short outputs it hides much of a decoder's gain), the mean acceptance length (tokens per
verify step: accepted drafts + the bonus token), tokens per target forward, and whether the greedy
output equals ``ar``'s token for token (it must). Draft sizes follow the cost budget as served
(``--budget fixed``: the whole tree every step). The suffix cache holds the outputs of earlier
prompts, never another mode's output for the same prompt. With ``--llama-cpp`` the same token ids
also go through llama.cpp (``llama_cpp`` package, if installed) on the GGUF file. Prefix caching
is off so every run computes its whole prompt.
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

from dualserve.clients.bench import DEFAULT_PROMPTS
from dualserve.models.quant import QUANTIZATIONS

AGENTIC_PROMPTS = Path(__file__).parent / "prompts" / "agentic.jsonl"
MODES = {"ar": ("ar", "auto"), "head": ("eagle", "head"), "suffix": ("eagle", "suffix"), "both": ("eagle", "both"),
         "block": ("eagle", "block"), "both-no-datastore": ("eagle", "both")}
NO_DATASTORE = {"both-no-datastore"}  # modes run with the datastore set aside


@dataclass
class Case:
    id: str
    kind: str
    messages: list[dict]


@dataclass
class Row:
    set: str
    id: str
    kind: str
    mode: str
    tokens: int
    seconds: float
    accept_length: float
    tokens_per_forward: float
    identical: bool
    first: float = 0.0  # seconds to the first token

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_tps(self) -> float:
        """Tokens after the first over the time after it."""
        return (self.tokens - 1) / (self.seconds - self.first) if self.tokens > 1 and self.seconds > self.first else 0.0


def load_cases(path: Path | str) -> list[Case]:
    """A JSONL prompt set: "messages" (a conversation) where given, else "prompt" as one user turn."""
    cases = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            obj = json.loads(line)
            messages = obj.get("messages") or [{"role": "user", "content": obj["prompt"]}]
            cases.append(Case(obj["id"], obj["kind"], messages))
    return cases


def generate(engine, model: str, mode: str, ids: list[int], max_tokens: int) -> tuple[list[int], float, dict, float]:
    """One greedy request through ``engine``: (tokens, seconds, stats, seconds to the first token).
    ``mode``: one of ``MODES``, or a decoder's name (its default drafts, for eagle)."""
    from dualserve.decoders.engine.sampling import SamplingParams

    decoder, draft = MODES.get(mode, (mode, "auto"))
    deltas, first = [], []
    start = time.perf_counter()

    def on_delta(_, d) -> None:
        if d.token_ids and not first:
            first.append(time.perf_counter() - start)
        deltas.append(d)

    engine.submit(model, decoder, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, draft=draft), on_delta)
    engine.run_until_idle()
    elapsed = time.perf_counter() - start
    return [t for d in deltas for t in d.token_ids], elapsed, deltas[-1].stats or {}, (first or [elapsed])[0]


def llama_cpp_runner(gguf: Path, threads: int):
    """A function ids -> (tokens, seconds, seconds to the first token) through llama.cpp, or None
    when it is not installed."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(gguf), n_ctx=2048, n_threads=threads or None, verbose=False)

    def run(ids: list[int], max_tokens: int) -> tuple[int, float, float]:
        llm.reset()
        start, first, n = time.perf_counter(), 0.0, 0
        for _ in llm.create_completion(ids, max_tokens=max_tokens, temperature=0.0, stream=True):
            n += 1  # one chunk per token
            first = first or time.perf_counter() - start
        return n, time.perf_counter() - start, first

    return run


def served_format(quantization: str, path: Path, cache: Path):
    """(quantization, dtype, format table) as ``dualserve serve --quantization ...`` picks them on this
    host: with auto, the format the host's measured table picks."""
    from dualserve.server.cli import pick_format
    from dualserve.server.settings import ModelSpec

    return pick_format(ModelSpec(cache_dir=cache, quantization=quantization), path, cache, torch.float32)


def deploy(args: argparse.Namespace):
    """(engine, model name, tokenizer, model path, the eagle decoder) as ``serve`` builds them."""
    from dualserve.decoders.deployment import CompileSpec, PoolSpec, ServedSpec, build_deployment
    from dualserve.decoders.eagle.tree import TreeConfig
    from dualserve.decoders.engine.engine import EngineConfig
    from dualserve.models.assets import default_datastore, default_eagle_head
    from dualserve.models.formats import cached_measure
    from dualserve.models.hub import default_cache_dir, resolve_model
    from dualserve.models.loader import load_model
    from dualserve.server.cli import bundled
    if args.threads:
        torch.set_num_threads(args.threads)
    cache = default_cache_dir(args.cache_dir)
    name, path = resolve_model(args.model, cache)
    quantization, dtype, table = served_format(args.quantization, path, cache)
    loaded = load_model(path, name=name, cache_dir=cache, quantization=quantization, dtype=dtype)
    head = Path(args.head) if args.head else default_eagle_head(name)
    table = (table or cached_measure(loaded.config, cache / "host")) if args.budget == "cost" else None
    compile_spec = CompileSpec(cache_dir=cache / "compile") if args.compile else None
    dflash = Path(args.dflash) if args.dflash else None
    datastore = bundled(args.datastore, name, default_datastore)
    dep = build_deployment([ServedSpec(name, loaded, eagle_head=head or "suffix", dflash=dflash, datastore=datastore)],
                           EngineConfig(enable_prefix_caching=False), PoolSpec(num_blocks=args.num_blocks),
                           compile=compile_spec, format_table=table)
    if compile_spec is not None:  # measure compiled steps only: wait for every graph (built or loaded)
        while compile_spec.worker.busy:
            time.sleep(0.5)
        for runner in dep.runners.values():
            if runner.compiled is not None:
                print("compiled graphs:", ", ".join(f"{k} {v} ({runner.compiled.seconds[k]:.1f} s)"
                                                   for k, v in runner.compiled.how.items()), file=sys.stderr)
    decoder = dep.engine.decoders[(name, "eagle")]
    head_graph = getattr(decoder.sources.get("head"), "graph", None)
    if compile_spec is not None and head_graph is not None:
        print(f"the head's graph: {head_graph.how or 'eager'} ({head_graph.seconds:.1f} s)", file=sys.stderr)
    if args.budget == "fixed":
        decoder.cost = None
    if args.depth:
        decoder.tree = TreeConfig(args.depth, args.top_k, args.num_nodes)
    if head is None:
        print(f"no EAGLE head for {name}: head and both modes draft from suffix lookup alone", file=sys.stderr)
    return dep.engine, name, loaded.tokenizer, path, decoder


def bench(args: argparse.Namespace) -> tuple[list[Row], dict[str, float]]:
    engine, name, tok, path, decoder = deploy(args)
    modes = [m for m in args.modes.split(",") if m]
    llama = llama_cpp_runner(path, args.threads) if args.llama_cpp and path.suffix == ".gguf" else None
    rows: list[Row] = []
    llama_tps: dict[str, list[tuple[int, float, float]]] = {}
    warm = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hello!"}], add_generation_prompt=True),
                      add_special_tokens=False)
    for mode in modes:  # unmeasured warm-up
        generate(engine, name, mode, warm, 8)
    datastore = decoder.suffix.datastore if decoder.suffix is not None else None
    if datastore is None and NO_DATASTORE & set(modes):
        print("no datastore is loaded: without-datastore modes skipped", file=sys.stderr)
        modes = [m for m in modes if m not in NO_DATASTORE]
    for path_ in args.prompts:
        set_name = Path(path_).stem
        cases = load_cases(path_)[: args.limit or None]
        for i, case in enumerate(cases):
            ids = tok.encode(tok.apply_chat_template(case.messages, add_generation_prompt=True),
                             add_special_tokens=False)
            cache = decoder.suffix.cache if decoder.suffix is not None else None
            before = set(cache.entries) if cache is not None else set()
            out = {}
            for mode in modes[i % len(modes):] + modes[: i % len(modes)]:
                if cache is not None:  # the cache never holds this prompt's output from another mode
                    for key in [k for k in cache.entries if k not in before]:
                        cache.remove(key)
                    decoder.suffix.datastore = None if mode in NO_DATASTORE else datastore
                out[mode] = generate(engine, name, mode, ids, args.max_tokens)
            reference = out["ar"][0] if "ar" in out else None
            for mode in modes:
                got, seconds, stats, first = out[mode]
                rows.append(Row(set_name, case.id, case.kind, mode, len(got), seconds,
                                stats.get("mean_accept_length", 1.0), stats.get("tokens_per_forward", 1.0),
                                reference is None or got == reference, first))
            if llama:
                llama_tps.setdefault(set_name, []).append(llama(ids, args.max_tokens))
            print(f"{set_name}/{case.id:<10} " + "  ".join(
                f"{r.mode} {r.tps:5.1f} ({r.decode_tps:5.1f}) tok/s tau {r.accept_length:4.2f}"
                f"{'' if r.identical else ' DIFFERS'}"
                for r in rows[-len(modes):]), file=sys.stderr, flush=True)
    return rows, {k: llama_rates(v) for k, v in llama_tps.items()}


def llama_rates(runs: Sequence[tuple[int, float, float]]) -> dict[str, float]:
    """llama.cpp's tok/s over a set's prompts, end to end and after the first token."""
    tokens, seconds = sum(n for n, _, _ in runs), sum(s for _, s, _ in runs)
    return {"tps": tokens / max(seconds, 1e-9), "decode_tps": decode_rate(runs)}


def summary(rows: Sequence[Row]) -> list[dict]:
    """Per prompt set and mode: tok/s over all its prompts, ratio to ar, acceptance, identity."""
    out = []
    for set_name in dict.fromkeys(r.set for r in rows):
        of_set = [r for r in rows if r.set == set_name]
        ar = [r for r in of_set if r.mode == "ar"]
        ar_tps = sum(r.tokens for r in ar) / sum(r.seconds for r in ar) if ar else 0.0
        ar_decode = decode_rate(ar) if ar else 0.0
        for mode in dict.fromkeys(r.mode for r in of_set):
            rs = [r for r in of_set if r.mode == mode]
            tps = sum(r.tokens for r in rs) / max(sum(r.seconds for r in rs), 1e-9)
            out.append({"set": set_name, "mode": mode, "prompts": len(rs), "tps": tps,
                        "ratio_to_ar": tps / ar_tps if ar_tps else None,
                        "decode_tps": decode_rate(rs),
                        "decode_ratio": decode_rate(rs) / ar_decode if ar_decode else None,
                        "median_ratio": statistics.median(r.tps / a.tps for r, a in zip(rs, ar)) if ar else None,
                        "accept_length": statistics.mean(r.accept_length for r in rs),
                        "tokens_per_forward": statistics.mean(r.tokens_per_forward for r in rs),
                        "identical": sum(r.identical for r in rs)})
    return out


def decode_rate(runs: Sequence[Row | tuple[int, float, float]]) -> float:
    """Tokens after the first over the time after it, over ``runs`` (rows, or (tokens, seconds,
    seconds to the first token))."""
    many = [r if isinstance(r, tuple) else (r.tokens, r.seconds, r.first) for r in runs]
    many = [(n, s, f) for n, s, f in many if n > 1]
    return sum(n - 1 for n, _, _ in many) / max(sum(s - f for _, s, f in many), 1e-9)


def print_table(s: list[dict], llama_tps: dict[str, dict[str, float]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="speculative decoding by draft source vs plain AR, single stream, greedy")
    for col in ("set", "mode", "tok/s", "x ar", "median x ar", "decode tok/s", "decode x ar", "accept len",
                "tok/forward", "identical"):
        table.add_column(col, justify="left" if col in ("set", "mode") else "right")
    for r in s:
        table.add_row(r["set"], r["mode"], f"{r['tps']:.1f}",
                      f"{r['ratio_to_ar']:.2f}x" if r["ratio_to_ar"] else "-",
                      f"{r['median_ratio']:.2f}x" if r["median_ratio"] else "-", f"{r['decode_tps']:.1f}",
                      f"{r['decode_ratio']:.2f}x" if r["decode_ratio"] else "-", f"{r['accept_length']:.2f}",
                      f"{r['tokens_per_forward']:.2f}", f"{r['identical']}/{r['prompts']}")
    for set_name, rates in llama_tps.items():
        table.add_row(set_name, "llama.cpp", f"{rates['tps']:.1f}", "", "", f"{rates['decode_tps']:.1f}", "", "", "",
                      "")
    Console(width=max(Console().width, 120)).print(table)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dualserve.clients.bench_eagle", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="target (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--head", default=None, help="EAGLE head directory (default: the bundled one for the model)")
    p.add_argument("--datastore", default="auto", help="answers for suffix drafts, as serve's --datastore "
                   "(auto: the bundled one for the default model; none: without)")
    p.add_argument("--dflash", default=None, help="a DFlash drafter directory, for the block mode")
    p.add_argument("--prompts", nargs="+", default=[str(DEFAULT_PROMPTS), str(AGENTIC_PROMPTS)],
                   help="prompt sets (JSONL with prompt or messages)")
    p.add_argument("--modes", default=None, help="comma-separated, from " + ", ".join(MODES) +
                   " (default: all; block only with --dflash)")
    p.add_argument("--quantization", default="auto", choices=["auto", *QUANTIZATIONS],
                   help="weight format (auto: the one the server picks on this host, from its format table)")
    p.add_argument("--compile", action="store_true",
                   help="compiled steps, as the server runs them (waits until every graph is built or loaded)")
    p.add_argument("--limit", type=int, default=0, help="first N prompts of each set only")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--budget", choices=["cost", "fixed"], default="cost",
                   help="draft sizes: from the measured cost (as served) or the whole tree every step")
    p.add_argument("--depth", type=int, default=0, help="head tree depth (0: the decoder's default tree)")
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--num-nodes", type=int, default=10)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--llama-cpp", action="store_true", help="also time llama.cpp on the GGUF file")
    p.add_argument("--json", default=None, help="write rows and summary here")
    args = p.parse_args(argv)
    if args.modes is None:
        args.modes = ",".join(m for m in MODES if m != "block" or args.dflash)
    if "block" in args.modes.split(",") and not args.dflash:
        p.error("mode block needs --dflash DIR")
    if unknown := [m for m in args.modes.split(",") if m and m not in MODES]:
        p.error(f"unknown modes {unknown}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rows, llama_tps = bench(args)
    s = summary(rows)
    print_table(s, llama_tps)
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": s, "llama_cpp": llama_tps,
                                               "rows": [asdict(r) | {"tps": r.tps} for r in rows]}, indent=2))
    return 0 if all(r.identical for r in rows) else 1


if __name__ == "__main__":
    from dualserve.models.errors import one_line

    raise SystemExit(one_line(main))
