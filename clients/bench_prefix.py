"""Prefix caching: time to first token for a long prompt seen before, against a cold prompt of the same length.

Each cold request gets a unique long prefix (nothing to reuse); each warm request
repeats one long prefix with a different short question at the end, so only the
question is prefilled. Reports median TTFT for both and their ratio.

    python -m dualserve.clients.bench_prefix --base-url http://127.0.0.1:8000/v1 --prefix-words 600
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from openai import OpenAI

WORDS = ("alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river mountain forest ocean "
         "ledger account balance payment invoice audit policy client branch").split()


def document(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def ttft(client: OpenAI, model: str, prompt: str) -> float:
    start = time.perf_counter()
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0, stream=True,
                                       extra_body={"decoder": "ar"})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            return time.perf_counter() - start
    return time.perf_counter() - start


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default=None)
    p.add_argument("--prefix-words", type=int, default=600)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    client = OpenAI(base_url=args.base_url, api_key="unused", timeout=600)
    model = args.model or client.models.list().data[0].id
    shared = document(0, args.prefix_words)
    ttft(client, model, shared + "\nQuestion 0: summarise.")  # fill the cache
    cold, warm = [], []
    for i in range(args.rounds):
        cold.append(ttft(client, model, document(1000 + i, args.prefix_words) + f"\nQuestion {i}: summarise."))
        warm.append(ttft(client, model, shared + f"\nQuestion {i + 1}: summarise."))
    c, w = statistics.median(cold), statistics.median(warm)
    print(f"TTFT cold {c * 1000:.1f} ms, prefix-cached {w * 1000:.1f} ms, ratio {w / c:.3f} ({c / w:.1f}x faster)")


if __name__ == "__main__":
    from dualserve.models.errors import one_line

    raise SystemExit(one_line(main))
