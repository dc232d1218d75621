"""``python -m dualserve.decoders.training.fewshot_prompts``: a varied set of user messages for
self-distillation, written by a model continuing a few-shot list.

The generated set (``distil_prompts``) is templated: a draft head trained on its answers predicts the
target's next token 0.65 of the time on more of the same, but 0.45 on the held-out evaluation prompts
(``eagle_eval``). A base or instruct model continuing a list of real-looking messages writes prompts
with the spread of real traffic instead. Each request shows the model four seed messages of one kind
(chat, code, JSON extraction, summaries, facts, arithmetic; the seeds below, none of them an
evaluation prompt) as JSON lines and samples the fifth; extraction and summary requests start from a
fixed opener so that the model writes the text to work on. Messages that do not parse, are short,
repeat, or overlap an evaluation prompt are dropped.

It talks to any OpenAI-compatible ``/v1/completions`` endpoint (``dualserve serve`` by default on
the embedded model), so a larger model elsewhere can write the prompts the target then answers:

    dualserve serve --port 8101 --max-num-seqs 64 &
    python -m dualserve.decoders.training.fewshot_prompts --url http://127.0.0.1:8101/v1 --requests 5000 \
        --out prompts.jsonl
    python -m dualserve.decoders.training.distil --prompts prompts.jsonl --out <dir> --concurrency 64 --compile
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from pathlib import Path

from .distil_prompts import default_held_out

SEEDS = {
    "chat": [
        "How do I get rid of fruit flies in my kitchen?",
        "My dog keeps barking at night. What can I do?",
        "Write a birthday message for my grandmother who is turning 90.",
        "What's a good way to learn Spanish if I only have 15 minutes a day?",
        "I'm nervous about giving a presentation at work next week. Any advice?",
        "Write a haiku about the ocean.",
        "How should I store fresh herbs so they last longer?",
        "Give me a packing list for a weekend camping trip.",
        "Can you suggest a few board games for a family with teenagers?",
        "I want to start journaling. How do I keep the habit going?",
        "Write a short thank-you note to my neighbour who watered my plants while I was away.",
        "What should I look for when buying a used bike?",
        "My roommate never does the dishes. How can I bring it up without a fight?",
        "Tell me a short bedtime story about a brave little turtle.",
        "What are some healthy snacks I can take to the office?",
        "How can I make my small apartment feel bigger?",
    ],
    "code": [
        "Write a Python function that counts how many vowels are in a string.",
        "How do I reverse a list in Python without using reverse()?",
        "Write a SQL query to find all orders placed in the last 7 days from a table orders(id, customer_id, created_at).",
        "What does the `yield` keyword do in Python?",
        "Write a JavaScript function that returns the largest number in an array.",
        "Explain the difference between a list and a tuple in Python.",
        "Why does this code raise an error?\n\nnums = [1, 2, 3]\nprint(nums[3])",
        "Write a Python function that merges two sorted lists into one sorted list.",
        "How do I read a JSON file in Python?",
        "Write a bash command that finds all files larger than 100 MB in my home directory.",
        "What is a race condition? Give a simple example.",
        "Write a Python function `is_prime(n)`.",
    ],
    "json_extraction": [
        "Extract the city, date and temperature from this sentence as JSON: \"On 3 May, Lisbon reached 27 degrees.\"",
        "Return JSON with keys title, author and year for: \"The novel Beloved was written by Toni Morrison and published in 1987.\"",
        "Turn this into JSON with fields name and phone: \"You can reach Daniel Kim at 555-0142.\"",
        "From the text below, extract the company, role and salary as JSON.\n\nText: Nordwind GmbH is hiring a data analyst at 52,000 EUR per year.",
        "Give me a JSON object with keys item, quantity and price from: \"Bought 4 notebooks for 2.75 each.\"",
        "Parse this address into JSON with street, city and postcode: 12 Elm Road, Bristol, BS1 4DJ",
    ],
    "summarisation": [
        "Summarize in one sentence: The city council voted on Tuesday to extend the bike lane network by 20 kilometres over the next two years, citing a rise in cycling commuters and fewer traffic accidents on streets with protected lanes.",
        "Give me a two-sentence summary of this email: Hi team, the server migration planned for Friday is postponed to next Wednesday because the vendor needs more time to test the backups. Please keep your deployments frozen until then. Thanks, Aisha",
        "Summarize the main point of this paragraph: Sleep helps the brain store memories. During deep sleep, the brain replays what was learned during the day, which strengthens the connections between neurons.",
        "TL;DR this review: The hotel was clean and the staff were friendly, but the rooms were small and the Wi-Fi kept dropping. Breakfast was great value.",
    ],
    "factual": [
        "Why does bread go stale?",
        "What is the difference between a virus and a bacterium?",
        "Summarize the causes of World War I in a few sentences.",
        "How do vaccines work?",
        "What is inflation, in simple terms?",
        "Who was Marie Curie?",
        "Why do cats purr?",
        "What causes the seasons on Earth?",
        "How does a credit score work?",
        "What is the tallest mountain in Africa?",
    ],
    "arithmetic": [
        "If a shirt costs 24 dollars and is 25% off, what is the sale price?",
        "A train travels 180 km in 2 hours. What is its average speed?",
        "I have 3 boxes with 12 eggs each and 5 eggs break. How many are left?",
        "What is 35% of 180?",
        "Sam is twice as old as Mia. In 4 years their ages add up to 32. How old is Mia now?",
        "How many minutes are there in 3.5 hours?",
    ],
}

WEIGHTS = {"chat": 4, "code": 3, "json_extraction": 1.5, "summarisation": 1.5, "factual": 2, "arithmetic": 1.5}
OPENERS = {
    "json_extraction": ["Extract ", "Return JSON with ", "Turn this into JSON", "From the text below, extract ",
                        "Give me a JSON object with ", "Parse this ", "Convert this to JSON: "],
    "summarisation": ["Summarize in one sentence: ", "Give me a two-sentence summary of this email: ",
                      "Summarize the main point of this paragraph: ", "TL;DR this review: ",
                      "Summarize this article in three bullet points: ", "What is the gist of this message? "],
}
HEAD = "Messages that users sent to an AI assistant, one JSON object per line:\n\n"


def request(seed: int, index: int) -> tuple[str, str, str]:
    """Request ``index``'s kind, opener and few-shot prompt (a function of seed and index alone)."""
    r = random.Random(f"{seed}:{index}")
    kinds = list(WEIGHTS)
    kind = r.choices(kinds, [WEIGHTS[k] for k in kinds])[0]
    shots = r.sample(SEEDS[kind], min(4, len(SEEDS[kind])))
    opener = r.choice(OPENERS[kind]) if kind in OPENERS else ""
    return kind, opener, HEAD + "".join(json.dumps({"message": q}) + "\n" for q in shots) + '{"message": "' + opener


def message(opener: str, text: str) -> str | None:
    """The sampled fifth message, or None when its JSON line does not close."""
    try:
        return str(json.loads('{"message": "' + opener + text.split("\n")[0].strip())["message"]).strip()
    except (json.JSONDecodeError, KeyError, TypeError):
        return None


async def generate(url: str, requests: int, out: Path, seed: int, concurrency: int, temperature: float) -> int:
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="none", timeout=600)
    model = (await client.models.list()).data[0].id
    held_out = default_held_out()
    seen = {" ".join(json.loads(line)["prompt"].split()).lower() for line in out.open()} if out.exists() else set()
    gate = asyncio.Semaphore(concurrency)
    with out.open("a") as f:
        async def one(i: int) -> None:
            kind, opener, prompt = request(seed, i)
            async with gate:
                try:
                    r = await client.completions.create(model=model, prompt=prompt, max_tokens=160, seed=seed + i,
                                                        temperature=temperature, stop=["\n{", "\n\n"])
                except openai.OpenAIError:
                    return
            msg = message(opener, r.choices[0].text)
            key = " ".join((msg or "").split()).lower()
            if msg is None or len(key) < 15 or key in seen or msg in SEEDS[kind] or held_out.overlaps(msg):
                return
            seen.add(key)
            f.write(json.dumps({"kind": kind, "prompt": msg}) + "\n")
            f.flush()

        await asyncio.gather(*(one(i) for i in range(requests)))
    return len(seen)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dualserve.decoders.training.fewshot_prompts",
                                description="User messages for self-distillation, by few-shot continuation.")
    p.add_argument("--url", default="http://127.0.0.1:8000/v1", help="an OpenAI-compatible server's base URL")
    p.add_argument("--requests", type=int, default=5000, help="completions to ask for (about 3 in 4 are kept)")
    p.add_argument("--out", required=True, help="JSONL file to append to; its messages are not written again")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.9)
    args = p.parse_args(argv)
    import openai

    try:
        n = asyncio.run(generate(args.url, args.requests, Path(args.out), args.seed, args.concurrency,
                                 args.temperature))
    except (openai.OpenAIError, OSError) as e:
        raise SystemExit(f"fewshot_prompts: {args.url}: {e}")
    print(f"{args.out}: {n} messages")
    return 0


if __name__ == "__main__":
    from dualserve.models.errors import one_line

    raise SystemExit(one_line(main))
