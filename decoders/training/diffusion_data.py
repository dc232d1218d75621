"""Self-distilled training data for diffusion twins: the AR model's own greedy answers.

A twin should say what its AR parent says, only several tokens per forward, so
its training targets are the parent's own greedy answers (the self-distillation
that EAGLE, section 4.3, uses for draft heads; Fast-dLLM v2, section 4.1, trains
on SFT data instead, which a small CPU run cannot afford to fit from scratch).

Prompts come from three places:
  - the templated chat / code / extraction / summary / reasoning / factual set
    of ``eagle_prompts.py``;
  - exact-answer kinds added here (copying, JSON extraction, short arithmetic,
    one-word facts, short lists), where a twin's errors are visible;
  - any JSONL prompt files given (``{"prompt": ...}`` per line), such as
    ``clients/prompts/bench.jsonl``.

Answers are generated in one batch through the serving engine (continuous
batching over the paged KV pool, greedy, chat template applied), which is far
faster than one prompt at a time. Each finished answer is appended to a JSONL
file at once, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Callable

from dualserve.models.loader import LoadedModel

from .eagle_prompts import CITIES, ITEMS, JOBS, NAMES, TOPICS, build_prompts

WORDS = ["river", "candle", "orbit", "maple", "signal", "harbor", "velvet", "quartz", "meadow", "lantern",
         "copper", "whistle", "glacier", "pepper", "ribbon", "thunder", "saddle", "walnut", "prism", "falcon"]
COUNTRIES = {"France": "Paris", "Japan": "Tokyo", "Canada": "Ottawa", "Italy": "Rome", "Germany": "Berlin",
             "Spain": "Madrid", "Egypt": "Cairo", "Kenya": "Nairobi", "Norway": "Oslo", "Peru": "Lima",
             "China": "Beijing", "Russia": "Moscow", "India": "New Delhi", "Mexico": "Mexico City"}


def _copy(r: random.Random) -> str:
    words = " ".join(r.choice(WORDS) for _ in range(r.randint(3, 9)))
    return r.choice([
        f"Repeat exactly: {words}",
        f"Copy this text word for word: \"{words}\"",
        f"Write the following words in reverse order: {words}",
        f"Write this sentence in capital letters: {words}",
    ])


def _json(r: random.Random) -> str:
    name, city, job = r.choice(NAMES), r.choice(CITIES), r.choice(JOBS)
    age, n = r.randint(19, 78), r.randint(2, 9)
    item = r.choice(ITEMS)
    return r.choice([
        f"Extract the name and city as JSON with keys \"name\" and \"city\": {name} lives in {city}.",
        f"Give a JSON object with keys \"item\" and \"count\" for: I bought {n} {item}.",
        f"Convert to JSON with keys name, age, job: {name}, {age}, {job}.",
        f"Output only JSON. Text: \"{name} ({age}) works as a {job} in {city}.\" Keys: name, age, city.",
    ])


def _arithmetic(r: random.Random) -> str:
    a, b = r.randint(2, 99), r.randint(2, 99)
    op, sym = r.choice([("+", "plus"), ("-", "minus"), ("*", "times")])
    return r.choice([
        f"What is {a} {op} {b}? Answer with just the number.",
        f"Compute {a} {sym} {b}.",
        f"What is {a} {sym} {b}?",
        f"Calculate {a} {op} {b} and explain in one sentence.",
    ])


def _fact(r: random.Random) -> str:
    country = r.choice(list(COUNTRIES))
    return r.choice([
        f"What is the capital of {country}? Answer in one word.",
        f"Name the capital city of {country}.",
        f"In one sentence, what is {r.choice(TOPICS)}?",
        f"List three words that rhyme with {r.choice(WORDS)}.",
        f"List {r.randint(3, 6)} colors, separated by commas.",
        f"What comes after {r.choice(['Monday', 'March', 'seven', 'Tuesday', 'June'])}?",
    ])


EXACT_KINDS: dict[str, Callable[[random.Random], str]] = {
    "copy": _copy, "json": _json, "arithmetic": _arithmetic, "fact": _fact}


def twin_prompts(n: int, seed: int = 0, extra_files: list[str] | None = None) -> list[str]:
    """``n`` prompts: half templated (``eagle_prompts``), half exact-answer kinds, plus any files, deduplicated."""
    r = random.Random(seed + 1)
    kinds = list(EXACT_KINDS.values())
    out = build_prompts(n - n // 2, seed)
    out += [kinds[i % len(kinds)](r) for i in range(n // 2)]
    for path in extra_files or []:
        out += [json.loads(line)["prompt"] for line in Path(path).read_text().splitlines() if line.strip()]
    seen: set[str] = set()
    out = [p for p in out if not (p in seen or seen.add(p))]
    r.shuffle(out)  # any prefix of the list is a balanced mix, so a shortened run still covers every kind
    return out


def chat_prompt_ids(loaded: LoadedModel, prompt: str) -> list[int]:
    tok = loaded.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def read_dataset(path: Path) -> list[dict]:
    """Records ``{"prompt", "prompt_ids", "answer_ids", "finish"}``; a torn last line is ignored."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def generate_dataset(loaded: LoadedModel, prompts: list[str], path: Path, *, max_new_tokens: int,
                     max_prompt_len: int, concurrency: int, log: Callable[[str], None]) -> list[dict]:
    """Answer every prompt not yet in ``path`` greedily through the engine, appending as answers finish."""
    from ..deployment import PoolSpec, build_deployment
    from ..engine.engine import EngineConfig
    from ..engine.sampling import SamplingParams

    done = {rec["prompt"] for rec in read_dataset(path)}
    todo = [p for p in prompts if p not in done]
    if not todo:
        return read_dataset(path)
    per_seq_blocks = -(-(max_prompt_len + max_new_tokens) // 16) + 1
    dep = build_deployment([loaded], EngineConfig(max_num_seqs=concurrency, max_batched_tokens=2048,
                                                  max_waiting=len(todo) + 1),
                           PoolSpec(block_size=16, num_blocks=concurrency * per_seq_blocks + 16))
    engine = dep.engine
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
    path.parent.mkdir(parents=True, exist_ok=True)
    answers: dict[int, list[int]] = {}
    finished = [0, 0]  # prompts, answer tokens
    started = time.perf_counter()
    with path.open("a") as out:
        def sink_for(prompt: str, ids: list[int]):
            def sink(_index: int, delta) -> None:
                toks = answers.setdefault(id(ids), [])
                toks += delta.token_ids
                if delta.finish_reason is not None:
                    out.write(json.dumps({"prompt": prompt, "prompt_ids": ids, "answer_ids": toks,
                                          "finish": delta.finish_reason}) + "\n")
                    out.flush()
                    finished[0] += 1
                    finished[1] += len(toks)
                    if finished[0] % 50 == 0 or finished[0] == len(todo):
                        rate = finished[1] / (time.perf_counter() - started)
                        log(f"data: {finished[0]}/{len(todo)} answers, {finished[1]} tokens, {rate:.0f} tok/s")
            return sink

        for prompt in todo:
            ids = chat_prompt_ids(loaded, prompt)[-max_prompt_len:]
            engine.submit(loaded.name, "ar", ids, params, sink_for(prompt, ids))
        engine.run_until_idle()
    return read_dataset(path)
