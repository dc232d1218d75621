"""Single-stream decoding: dualserve's engine against transformers' ``generate``, side by side.

Both run in this process on the same GGUF file, the same prompts and greedy
decoding, alternating prompt by prompt so machine load affects both alike.
Reports load time, time to first token and decode tokens/s for each, their
ratio, and whether the greedy tokens are identical. transformers is a
development dependency (``pip install -e .[dev]``), used here only as the baseline.

    python -m dualserve.clients.bench_hf --max-tokens 64 --prompts 8
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dualserve.decoders.deployment import PoolSpec, build_deployment
from dualserve.decoders.engine.sampling import SamplingParams
from dualserve.models.hub import default_cache_dir, pull_default_model
from dualserve.models.loader import load_model

from .bench import load_prompts


def ours(engine, name: str, ids: list[int], max_tokens: int) -> tuple[list[int], float, float]:
    out: list[int] = []
    first: list[float] = []
    start = time.perf_counter()

    def sink(_: int, delta) -> None:
        if delta.token_ids and not first:
            first.append(time.perf_counter())
        out.extend(delta.token_ids)

    engine.submit(name, "ar", ids, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), sink)
    engine.run_until_idle()
    end = time.perf_counter()
    return out, first[0] - start, (len(out) - 1) / (end - first[0])


def theirs(model, ids: list[int], max_tokens: int) -> tuple[list[int], float, float]:
    x = torch.tensor([ids])
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(x, max_new_tokens=1, do_sample=False)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(x, max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens)
    total = time.perf_counter() - start
    new = out[0, len(ids):].tolist()
    # generate() re-runs the prefill; take it out so both sides count decode time only.
    return new, ttft, (len(new) - 1) / max(total - ttft, 1e-9)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    path = pull_default_model(default_cache_dir())
    start = time.perf_counter()
    loaded = load_model(path, name="default", cache_dir=default_cache_dir())
    our_load = time.perf_counter() - start
    dep = build_deployment([loaded], pool=PoolSpec(num_blocks=512))
    start = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    hf_load = time.perf_counter() - start
    tok = loaded.tokenizer
    prompts = [p.prompt for p in load_prompts()][: args.prompts]
    rows = []
    for text in prompts:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)
        a = ours(dep.engine, "default", ids, args.max_tokens)
        b = theirs(hf, ids, args.max_tokens)
        rows.append((a, b))
        print(f"ttft {a[1] * 1000:7.1f} ms vs {b[1] * 1000:7.1f} ms   decode {a[2]:6.1f} vs {b[2]:6.1f} tok/s   "
              f"identical={a[0] == b[0]}")
    ours_tps = statistics.median(r[0][2] for r in rows)
    hf_tps = statistics.median(r[1][2] for r in rows)
    print(f"\nload: dualserve {our_load:.2f} s, transformers {hf_load:.2f} s")
    print(f"time to first token (median): dualserve {statistics.median(r[0][1] for r in rows) * 1000:.1f} ms, "
          f"transformers {statistics.median(r[1][1] for r in rows) * 1000:.1f} ms")
    print(f"decode tok/s (median): dualserve {ours_tps:.1f}, transformers {hf_tps:.1f}, ratio {ours_tps / hf_tps:.2f}x")
    print(f"identical greedy outputs: {sum(r[0][0] == r[1][0] for r in rows)}/{len(rows)}")


if __name__ == "__main__":
    from dualserve.models.errors import one_line

    raise SystemExit(one_line(main))
