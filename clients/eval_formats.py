"""Quality of each weight format against fp32 on the exact-answer set, greedy AR.

Run as ``python -m dualserve.clients.eval_formats``. The default model is loaded in each format
of ``--formats`` (``none`` = fp32 float weights, ``bf16``, ``int8``, ``int4``; default
``none int8 int4``), one at a time, and every prompt of ``prompts/exact.jsonl`` is answered
greedily (``--max-tokens`` 48) by plain AR through an in-process engine, as in ``eval_twin``
(same prompts, same chat template, same checks). fp32 is the reference and always runs first.

Reported per format:

- **exact match**: the answer is right (``eval_twin.correct``). Arithmetic items count only where
  the fp32 answer is right (the prompt set's contract, see ``eval_twin``), so fp32's rate there
  is 1 by construction;
- **ratio to fp32**: exact match / fp32's, against the 0.95 target;
- **identical to fp32**: share of outputs equal to fp32's token for token, and the mean share of
  fp32's tokens matched position by position before the first difference (prefix agreement).

A tok/s column is printed for orientation only (eager, formats run one after another, so load on
a shared machine can skew it); ``bench_forward`` is the speed measurement. Eager forwards: quality
does not depend on compiling. ``--json PATH`` writes the summary and
every output text.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from .bench_eagle import generate
from .eval_twin import PROMPTS, correct, load_exact, prefix_agreement

# format -> (load_model's quantization, dtype); "none" and "fp32" are the same reference
FORMATS = {"none": ("none", torch.float32), "fp32": ("none", torch.float32), "bf16": ("none", torch.bfloat16),
           "int8": ("int8", torch.float32), "int4": ("int4", torch.float32),
           "w4a8": ("w4a8", torch.float32), "w4a16": ("w4a16", torch.float32)}
TARGET = 0.95


@dataclass
class FormatRun:
    format: str
    outputs: dict[str, list[int]] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)
    tokens: int = 0
    seconds: float = 0.0


def summarize(items: list[dict], runs: list[FormatRun]) -> dict:
    """Per format: exact match, ratio to the reference (``runs[0]``, fp32), identical share, prefix agreement."""
    ref = runs[0]
    # Arithmetic items count only where the fp32 answer is right (the prompt set's contract).
    scored = [it for it in items if it["check"] != "number" or correct(it, ref.texts[it["id"]])]
    rows = []
    for run in runs:
        em = sum(correct(it, run.texts[it["id"]]) for it in scored) / max(len(scored), 1)
        same = sum(run.outputs[it["id"]] == ref.outputs[it["id"]] for it in items) / max(len(items), 1)
        prefix = sum(prefix_agreement(ref.outputs[it["id"]], run.outputs[it["id"]])
                     for it in items) / max(len(items), 1)
        by_kind = {}
        for kind in sorted({it["kind"] for it in scored}):
            sub = [it for it in scored if it["kind"] == kind]
            by_kind[kind] = round(sum(correct(it, run.texts[it["id"]]) for it in sub) / len(sub), 3)
        rows.append({"format": run.format, "exact_match": round(em, 3), "by_kind": by_kind,
                     "identical_to_fp32": round(same, 3), "prefix_agreement": round(prefix, 3),
                     "tokens": run.tokens, "tok_s": round(run.tokens / run.seconds, 2) if run.seconds else 0.0})
    base = rows[0]["exact_match"]
    for r in rows:
        r["ratio_to_fp32"] = round(r["exact_match"] / base, 3) if base else 0.0
        r["meets_target"] = r["ratio_to_fp32"] >= TARGET
    return {"items": len(items), "scored": len(scored), "target": TARGET, "rows": rows,
            "outputs": {r.format: r.texts for r in runs}}


def format_table(summary: dict) -> str:
    cols = ["format", "exact_match", "ratio_to_fp32", "meets_target", "identical_to_fp32", "prefix_agreement",
            "tok_s"]
    table = [[("yes" if r[c] else "NO") if c == "meets_target" else str(r[c]) for c in cols] for r in summary["rows"]]
    widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(cols)]
    lines = [f"{summary['items']} prompts, {summary['scored']} scored (arithmetic only where fp32 is right); "
             f"target: exact match at least {summary['target']} of fp32's",
             "  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(t, widths)) for t in table]
    lines += [f"{r['format']}: {r['by_kind']}" for r in summary["rows"]]
    return "\n".join(lines)


def formats_in_order(formats: Sequence[str]) -> list[str]:
    """fp32 first (the reference, added when missing), then the others once each, in the order given."""
    out = ["none"]
    for f in formats:
        if FORMATS[f] != FORMATS["none"] and f not in out:
            out.append(f)
    return out


def evaluate(args: argparse.Namespace) -> dict:
    from dualserve.decoders.deployment import PoolSpec, build_deployment
    from dualserve.decoders.engine.engine import EngineConfig
    from dualserve.decoders.training.diffusion_data import chat_prompt_ids
    from dualserve.models.hub import default_cache_dir, resolve_model
    from dualserve.models.loader import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    cache = default_cache_dir(args.cache_dir)
    name, path = resolve_model(args.model, cache)
    items = load_exact(args.prompts)[: args.limit or None]
    runs = []
    for fmt in formats_in_order(args.formats):
        quantization, dtype = FORMATS[fmt]
        loaded = load_model(path, name=name, dtype=dtype, cache_dir=cache, quantization=quantization)
        dep = build_deployment([loaded], EngineConfig(enable_prefix_caching=False), PoolSpec(num_blocks=256))
        engine = dep.engine
        run = FormatRun("fp32" if fmt == "none" else fmt)
        generate(engine, name, "ar", chat_prompt_ids(loaded, "Hello!"), 4)  # warm-up
        for item in items:
            out, secs, _, _ = generate(engine, name, "ar", chat_prompt_ids(loaded, item["prompt"]), args.max_tokens)
            run.outputs[item["id"]] = out
            run.texts[item["id"]] = loaded.tokenizer.decode(out, skip_special_tokens=True)
            run.tokens += len(out)
            run.seconds += secs
        ok = sum(correct(it, run.texts[it["id"]]) for it in items)
        print(f"{run.format}: {ok}/{len(items)} right before scoring, {run.tokens} tokens in {run.seconds:.1f} s",
              flush=True)
        runs.append(run)
        del dep, engine, loaded
    return summarize(items, runs)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dualserve.clients.eval_formats", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model path (default: the default model's GGUF)")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--formats", nargs="+", choices=list(FORMATS), default=["none", "int8", "int4", "w4a8"],
                   help="none = fp32 (the reference, always run)")
    p.add_argument("--prompts", default=str(PROMPTS))
    p.add_argument("--limit", type=int, default=0, help="first N prompts (0: all)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--json", default=None, help="write the summary (with every output) here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    summary = evaluate(args)
    print(format_table(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    from dualserve.models.errors import one_line

    raise SystemExit(one_line(main))
