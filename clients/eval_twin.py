"""Quality and speed of a diffusion twin against its AR parent (and EAGLE), in one run.

Run as ``python -m dualserve.clients.eval_twin``. Every prompt of ``prompts/exact.jsonl``
(short factual questions, copying, JSON extraction from a given sentence, arithmetic; none of
their entities or templates appear in the twin's training prompts) is answered one at a time,
greedy, through one deployment of the default model (``ar``, ``eagle`` with the bundled head,
``diffusion`` with the twin), by every decoder and by the twin at every threshold. The order
of decoders rotates from prompt to prompt, so load drift hits all alike.

A second, free-form set (``--free-form``, default the chat prompts of ``prompts/bench.jsonl``,
also held out of every training set) has no single right answer; there each output is judged by
its agreement with AR's.

Reported per decoder (and per threshold for the twin):

- **exact match**: the answer is right (the capital named, the words copied, the JSON fields
  equal, the number stated). Arithmetic counts only where AR is right, as the prompt set's
  contract says, so AR's rate there is 1 by construction;
- **agreement** on both sets: the output equals AR's greedy output token for token; the mean
  share of AR's tokens matched position by position before the first difference (prefix
  agreement); and the token F1 of the two outputs as bags of tokens (SQuAD's answer F1), which
  still credits an answer that says the same thing after an early difference;
- **tokens per forward** and **single-stream tokens/s** over both sets, with ratios to AR.

Quality ratio = the twin's exact-match rate / AR's. ``--taus`` gives the speed/quality curve
over the unmasking threshold; a threshold above 1 commits one token per forward.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from .bench_eagle import generate, served_format
from dualserve.models.quant import QUANTIZATIONS

PROMPTS = Path(__file__).resolve().parent / "prompts" / "exact.jsonl"
FREE_FORM = Path(__file__).resolve().parent / "prompts" / "bench.jsonl"


def load_exact(path: Path | str = PROMPTS) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def first_json_object(text: str) -> dict | None:
    start = text.find("{")
    while start != -1:
        try:
            obj, _ = json.JSONDecoder().raw_decode(text[start:])
            return obj if isinstance(obj, dict) else None
        except json.JSONDecodeError:
            start = text.find("{", start + 1)
    return None


def correct(item: dict, text: str) -> bool:
    """Whether ``text`` answers ``item`` (see the module docstring)."""
    check, answer = item["check"], item["answer"]
    if check == "contains":
        return answer.lower() in " ".join(text.lower().split())
    if check == "number":
        return any(float(n) == float(answer) for n in re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", "")))
    obj = first_json_object(text)
    if obj is None:
        return False
    norm = {str(k).lower(): str(v).strip().lower() for k, v in obj.items()}
    return all(norm.get(k) == str(v).lower() for k, v in answer.items())


def prefix_agreement(ref: list[int], got: list[int]) -> float:
    """Share of ``ref``'s tokens that ``got`` matches position by position before the first difference."""
    n = 0
    for a, b in zip(ref, got):
        if a != b:
            break
        n += 1
    return n / max(len(ref), 1)


def token_f1(ref: list[int], got: list[int]) -> float:
    """F1 of the two token multisets (SQuAD's answer F1 over token ids); 1 when both are empty."""
    if not ref and not got:
        return 1.0
    common = sum((Counter(ref) & Counter(got)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(got), common / len(ref)
    return 2 * precision * recall / (precision + recall)


@dataclass
class Run:
    label: str
    decoder: str
    tau: float | None = None
    outputs: dict[str, list[int]] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)
    tokens: int = 0
    forwards: int = 0
    seconds: float = 0.0


def evaluate(args: argparse.Namespace) -> dict:
    from dualserve.decoders.deployment import CompileSpec, PoolSpec, ServedSpec, build_deployment
    from dualserve.decoders.training.diffusion_data import chat_prompt_ids
    from dualserve.decoders.diffusion.policies import Threshold
    from dualserve.decoders.engine.engine import EngineConfig
    from dualserve.models.loader import load_twin
    from dualserve.models.assets import BUNDLED_EAGLE, BUNDLED_TWIN, default_datastore
    from dualserve.models.hub import default_cache_dir, resolve_model
    from dualserve.models.loader import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    cache = default_cache_dir(None)
    name, path = resolve_model(None, cache)
    quantization, dtype, _ = served_format(args.quantization, path, cache)
    base = load_model(path, name=name, cache_dir=cache, quantization=quantization, dtype=dtype)
    twin = load_twin(args.twin or BUNDLED_TWIN[name], base=base, name=f"{name}-twin")
    head = Path(args.eagle or BUNDLED_EAGLE[name])
    spec = ServedSpec(name, base, eagle_head=head if head.exists() else None, twin=twin,
                      datastore=default_datastore(name))  # eagle as served
    compile_spec = CompileSpec(cache_dir=cache / "compile") if args.compile else None
    dep = build_deployment([spec], EngineConfig(enable_prefix_caching=False), PoolSpec(num_blocks=256),
                           compile=compile_spec)
    if compile_spec is not None:  # time compiled steps only, as the server runs them
        while compile_spec.worker.busy:
            time.sleep(0.5)
    engine = dep.engine
    diffusion = engine.decoders[(name, "diffusion")]
    default_cfg = diffusion.config
    runs = [Run("ar", "ar")] + ([Run("eagle", "eagle")] if spec.eagle_head else [])
    runs += [Run(f"diffusion tau={t:g}", "diffusion", t) for t in args.taus]
    items = load_exact(args.prompts)[: args.limit or None]
    free = [dict(it, check="free") for it in load_exact(args.free_form)][: args.free_form_limit or None] \
        if args.free_form_limit >= 0 else []
    generate(engine, name, "ar", chat_prompt_ids(base, "Hello!"), 4)  # warm-up
    for i, item in enumerate(items + free):
        ids = chat_prompt_ids(base, item["prompt"])
        k = i % len(runs)
        for run in runs[k:] + runs[:k]:
            if run.tau is not None:
                diffusion.config = dataclasses.replace(default_cfg, policy=Threshold(run.tau))
            out, secs, stats, _ = generate(engine, name, run.decoder, ids, args.max_tokens)
            forwards = int(stats.get("forward_passes", 0))
            run.outputs[item["id"]], run.texts[item["id"]] = out, base.tokenizer.decode(out, skip_special_tokens=True)
            run.tokens += len(out)
            run.forwards += forwards
            run.seconds += secs
        print(f"{item['id']:<10} " + "  ".join(
            f"{r.label}: " + (f"{token_f1(runs[0].outputs[item['id']], r.outputs[item['id']]):.2f}"
                              if item["check"] == "free" else str(int(correct(item, r.texts[item["id"]]))))
            for r in runs), flush=True)
    diffusion.config = default_cfg
    return summarize(items, runs, free)


def agreement(items: list[dict], ar: Run, run: Run) -> dict:
    """How ``run``'s outputs agree with AR's on ``items``: identical, prefix agreement, token F1 (means)."""
    n = max(len(items), 1)
    return {"identical_to_ar": round(sum(run.outputs[it["id"]] == ar.outputs[it["id"]] for it in items) / n, 3),
            "prefix_agreement": round(sum(prefix_agreement(ar.outputs[it["id"]], run.outputs[it["id"]])
                                          for it in items) / n, 3),
            "token_f1": round(sum(token_f1(ar.outputs[it["id"]], run.outputs[it["id"]]) for it in items) / n, 3)}


def summarize(items: list[dict], runs: list[Run], free: list[dict] = ()) -> dict:
    """Per run: exact match on ``items`` (and agreement with AR there), agreement with AR on the
    free-form ``free``, tokens per forward and tok/s over both."""
    ar = runs[0]
    # Arithmetic items count only where AR is right (the prompt set's contract).
    scored = [it for it in items if it["check"] != "number" or correct(it, ar.texts[it["id"]])]
    rows = []
    for run in runs:
        em = sum(correct(it, run.texts[it["id"]]) for it in scored) / max(len(scored), 1)
        by_kind = {}
        for kind in sorted({it["kind"] for it in scored}):
            sub = [it for it in scored if it["kind"] == kind]
            by_kind[kind] = round(sum(correct(it, run.texts[it["id"]]) for it in sub) / len(sub), 3)
        free_form = {f"free_{k}": v for k, v in agreement(list(free), ar, run).items()} if free else {}
        rows.append({"run": run.label, "exact_match": round(em, 3), "by_kind": by_kind,
                     **agreement(items, ar, run), **free_form, "tokens": run.tokens,
                     "tokens_per_forward": round(run.tokens / max(run.forwards, 1), 3),
                     "tok_s": round(run.tokens / max(run.seconds, 1e-9), 2)})
    base_em, base_tps = rows[0]["exact_match"], rows[0]["tok_s"]
    for r in rows:
        r["quality_vs_ar"] = round(r["exact_match"] / max(base_em, 1e-9), 3)
        r["speed_vs_ar"] = round(r["tok_s"] / max(base_tps, 1e-9), 3)
    return {"items": len(items), "scored": len(scored), "free_form": len(free), "rows": rows,
            "outputs": {r.label: r.texts for r in runs}}


def print_table(summary: dict) -> None:
    cols = ["run", "exact_match", "quality_vs_ar", "identical_to_ar", "prefix_agreement", "token_f1"]
    cols += ["free_identical_to_ar", "free_prefix_agreement", "free_token_f1"] if summary["free_form"] else []
    cols += ["tokens_per_forward", "tok_s", "speed_vs_ar"]
    table = [[str(r[c]) for c in cols] for r in summary["rows"]]
    widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(cols)]
    print(f"{summary['items']} exact-answer prompts, {summary['scored']} scored; "
          f"{summary['free_form']} free-form prompts judged by agreement with ar")
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for t in table:
        print("  ".join(v.ljust(w) for v, w in zip(t, widths)))
    for r in summary["rows"]:
        print(f"{r['run']}: {r['by_kind']}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dualserve.clients.eval_twin", description=__doc__.split("\n")[0])
    p.add_argument("--prompts", default=str(PROMPTS))
    p.add_argument("--limit", type=int, default=0, help="first N prompts (0: all)")
    p.add_argument("--free-form", default=str(FREE_FORM), help="free-form prompts, judged by agreement with ar")
    p.add_argument("--free-form-limit", type=int, default=24, help="first N free-form prompts (0: all, -1: none)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--taus", type=float, nargs="*", default=[0.5, 0.7, 0.9, 0.95, 1.01])
    p.add_argument("--twin", default=None, help="twin directory (default: the bundled one)")
    p.add_argument("--eagle", default=None, help="EAGLE head directory (default: the bundled one)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--quantization", default="none", choices=["auto", *QUANTIZATIONS],
                   help="the base model's weights (auto: the format the server serves on this host)")
    p.add_argument("--compile", action="store_true",
                   help="compiled steps, as the server runs them (waits until the graphs are built or loaded); "
                        "without it every decoder runs eager, which is slower and favours none")
    p.add_argument("--json", default=None, help="write the summary (with every output) here")
    args = p.parse_args(argv)
    summary = evaluate(args)
    print_table(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    from dualserve.models.errors import one_line

    raise SystemExit(one_line(main))
