"""Does a deployment give one answer per request at temperature 0? Checked from outside, on new prompts.

Run as ``python -m dualserve.clients.check_invariance --url http://127.0.0.1:8000/v1 [--url OTHER ...]``.
Every run draws prompts no earlier request has sent (a random topic, task and number each), so
none is in the prefix cache or the suffix drafter's memory before its first send. Through the
OpenAI SDK, greedy, chat:

- **fresh == cached**: a new prompt, then the same request again (its prompt now cached);
- **alone == batched**: ``--concurrency`` new prompts sent at once, then each alone;
- **eagle == ar**: a new prompt to ``eagle`` first (for each ``--drafts`` source), then to ``ar``;
- **deployment == first**: with more than one ``--url``, every prompt's ``ar`` answer from each other
  deployment against the first's (eager against compiled, one rank against two, another host).

Prints one line per check with how many answers were identical, and exits 1 if any differed.
``--json PATH`` writes every answer.
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

TOPICS = ["a lighthouse keeper", "copper wiring", "a bakery run by robots", "the moons of Jupiter", "tide pools",
          "a violin workshop", "rooftop solar panels", "a mountain railway", "honey bees", "a night market",
          "retreating glaciers", "paper airplanes", "an old typewriter", "desert cacti", "a submarine cable",
          "a chess opening", "sourdough bread", "a city bus timetable", "migrating cranes", "a tax form"]
TASKS = ["Write two sentences about {t}, mentioning the number {n}.",
         "Give three short facts about {t}. Start with the number {n}.",
         "Describe {t} to a child in one paragraph; include the year {n}.",
         "Write a Python function named f{n} that returns a one-line summary of {t}.",
         "Return a JSON object with keys name, count and note for {t}; count is {n}.",
         "Draft a polite two-line email asking about {t}, reference number {n}."]


def new_prompts(count: int, rng: random.Random) -> list[str]:
    return [rng.choice(TASKS).format(t=rng.choice(TOPICS), n=rng.randrange(10_000, 99_999)) for _ in range(count)]


class Deployment:
    """One server, asked greedy chat completions through the SDK."""

    def __init__(self, url: str, model: str | None, max_tokens: int):
        import openai

        self.client = openai.OpenAI(base_url=url, api_key="unused", timeout=600, max_retries=0)
        self.model = model or self.client.models.list().data[0].id
        self.max_tokens = max_tokens

    def ask(self, prompt: str, decoder: str = "ar", draft: str | None = None) -> str:
        extra = {"decoder": decoder, **({"draft": draft} if draft else {})}
        out = self.client.chat.completions.create(model=self.model, messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=self.max_tokens, temperature=0, extra_body=extra)
        return out.choices[0].message.content or ""


def check(args: argparse.Namespace) -> tuple[list[tuple[str, int, int]], dict]:
    rng = random.Random(args.seed if args.seed is not None else secrets.randbits(64))
    first, *others = [Deployment(u, args.model, args.max_tokens) for u in args.url]
    rows: list[tuple[str, int, int]] = []
    answers: dict[str, list] = {}

    prompts = new_prompts(args.prompts, rng)
    fresh = [first.ask(p) for p in prompts]
    cached = [first.ask(p) for p in prompts]
    rows.append(("fresh == cached", sum(a == b for a, b in zip(fresh, cached)), len(prompts)))
    answers["fresh"], answers["cached"] = list(zip(prompts, fresh)), cached

    batch = new_prompts(args.concurrency, rng)
    with ThreadPoolExecutor(args.concurrency) as pool:
        together = list(pool.map(first.ask, batch))
    alone = [first.ask(p) for p in batch]
    rows.append((f"alone == batched ({args.concurrency} at once)", sum(a == b for a, b in zip(alone, together)),
                 len(batch)))
    answers["batched"], answers["alone"] = list(zip(batch, together)), alone

    for draft in args.drafts:
        spec = new_prompts(args.prompts, rng)
        eagle = [first.ask(p, "eagle", draft) for p in spec]  # first: nothing of ar's answer is cached
        ar = [first.ask(p) for p in spec]
        rows.append((f"eagle ({draft}) == ar", sum(a == b for a, b in zip(eagle, ar)), len(spec)))
        answers[f"eagle-{draft}"] = list(zip(spec, eagle, ar))

    for i, other in enumerate(others, start=1):
        got = [other.ask(p) for p in prompts]
        rows.append((f"{args.url[i]} == {args.url[0]}", sum(a == b for a, b in zip(got, fresh)), len(prompts)))
        answers[f"deployment-{i}"] = got
    return rows, answers


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dualserve.clients.check_invariance",
                                description=__doc__.split("\n")[0])
    p.add_argument("--url", action="append", required=True, help="a deployment's /v1 URL (repeat to compare)")
    p.add_argument("--model", default=None, help="model name (default: the first the server lists)")
    p.add_argument("--prompts", type=int, default=12, help="new prompts per check")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--drafts", nargs="*", default=["auto"], help="eagle draft sources to check (empty: none)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=None, help="draw the same prompts again (default: new ones)")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rows, answers = check(args)
    for name, same, total in rows:
        print(f"{name:<60} {same}/{total} identical")
    if args.json:
        Path(args.json).write_text(json.dumps({"checks": rows, "answers": answers}, indent=2))
    return 0 if all(same == total for _, same, total in rows) else 1


if __name__ == "__main__":
    from dualserve.models.errors import one_line

    raise SystemExit(one_line(main))
