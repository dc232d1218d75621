"""Slot fillers for ``distil_prompts``: code snippets, record shapes, tools and their results.

Plain data plus small seeded generators, kept apart so the prompt kinds read as templates.
"""

from __future__ import annotations

import random
from typing import Any, Callable

from .eagle_prompts import CITIES, ITEMS, JOBS, NAMES

CODE_SNIPPETS: list[tuple[str, str]] = [
    ("Python", "def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs)"),
    ("Python", "def find_user(users, name):\n    for u in users:\n        if u['name'] == name:\n"
               "            return u\n    return None"),
    ("Python", "def word_counts(text):\n    counts = {}\n    for w in text.split():\n"
               "        counts[w] = counts.get(w, 0) + 1\n    return counts"),
    ("Python", "def is_palindrome(s):\n    s = s.lower()\n    return s == s[::-1]"),
    ("Python", "def chunk(items, size):\n    out = []\n    for i in range(0, len(items), size):\n"
               "        out.append(items[i:i + size])\n    return out"),
    ("Python", "def load_config(path):\n    with open(path) as f:\n        lines = f.readlines()\n"
               "    return dict(line.strip().split('=') for line in lines)"),
    ("Python", "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"
               "        self.items.append(x)\n\n    def pop(self):\n        return self.items.pop()"),
    ("Python", "def second_largest(nums):\n    nums.sort()\n    return nums[-2]"),
    ("JavaScript", "function sumPrices(items) {\n  let total = 0;\n  for (let i = 0; i <= items.length; i++) {\n"
                   "    total += items[i].price;\n  }\n  return total;\n}"),
    ("JavaScript", "function debounce(fn, ms) {\n  let t;\n  return (...args) => {\n    clearTimeout(t);\n"
                   "    t = setTimeout(() => fn(...args), ms);\n  };\n}"),
    ("JavaScript", "function groupBy(list, key) {\n  const out = {};\n  for (const x of list) {\n"
                   "    (out[x[key]] = out[x[key]] || []).push(x);\n  }\n  return out;\n}"),
    ("Go", "func Max(xs []int) int {\n\tm := xs[0]\n\tfor _, x := range xs {\n\t\tif x > m {\n\t\t\tm = x\n"
           "\t\t}\n\t}\n\treturn m\n}"),
    ("Rust", "fn count_vowels(s: &str) -> usize {\n    s.chars().filter(|c| \"aeiou\".contains(*c)).count()\n}"),
    ("SQL", "SELECT name, COUNT(*) FROM orders JOIN users ON users.id = orders.user_id GROUP BY name;"),
    ("Bash", "for f in *.log; do\n  gzip \"$f\"\ndone"),
]

FOLLOWUPS = [
    "Can you make that shorter?", "Thanks! Can you give me an example?", "Explain the second point in more detail.",
    "Now write the same thing for a beginner.", "Can you put that in a table?", "Why is that?",
    "What would you change if I had less time?", "Great. What should I do next?", "Can you double-check that?",
    "Rewrite it in a more formal tone.", "Summarize your answer in one sentence.", "Are there any risks?",
    "Can you add comments to explain each step?", "What are the alternatives?", "Turn that into a checklist.",
]


def _person(r: random.Random) -> tuple[str, list[str]]:
    name, city, job, age = r.choice(NAMES), r.choice(CITIES), r.choice(JOBS), r.randint(19, 78)
    return r.choice([
        (f"{name}, {age}, moved to {city} last year to work as a {job}.", ["name", "age", "city", "job"]),
        (f"Applicant: {name}. Current role: {job}. Based in {city}.", ["name", "job", "city"]),
        (f"Hello, my name is {name} and I am {age}. I live in {city}.", ["name", "age", "city"]),
    ])


def _order(r: random.Random) -> tuple[str, list[str]]:
    n, item, price, oid = r.randint(1, 30), r.choice(ITEMS), r.randint(2, 90), r.randint(10000, 99999)
    return (f"Order #{oid}: {n} {item} at ${price} each, shipping to {r.choice(CITIES)}.",
            ["order_id", "item", "quantity", "unit_price", "destination"])


def _event(r: random.Random) -> tuple[str, list[str]]:
    day, hour = r.randint(1, 28), r.randint(8, 18)
    month = r.choice(["January", "April", "June", "September", "November"])
    what = r.choice(["product launch", "board meeting", "team lunch", "workshop", "training day"])
    return (f"The {what} is on {month} {day} at {hour}:00 in the {r.choice(CITIES)} office; "
            f"{r.choice(NAMES)} will host.", ["event", "date", "time", "location", "host"])


def _contact(r: random.Random) -> tuple[str, list[str]]:
    name = r.choice(NAMES)
    user = name.lower().replace(" ", ".")
    return (f"You can reach {name} at {user}@example.com or +1 555 {r.randint(1000, 9999)}.",
            ["name", "email", "phone"])


def _product(r: random.Random) -> tuple[str, list[str]]:
    return (f"The {r.choice(['Nova', 'Aero', 'Pulse', 'Terra'])} {r.choice(['X', 'Pro', 'Mini'])} costs "
            f"${r.randint(20, 900)}, weighs {r.randint(100, 2000)} g and comes in "
            f"{r.choice(['black', 'silver', 'blue'])}.", ["product", "price", "weight_grams", "color"])


PEOPLE_FACTS: list[Callable[[random.Random], tuple[str, list[str]]]] = [_person, _order, _event, _contact, _product]


def _fn(name: str, description: str, props: dict[str, tuple[str, str]], required: list[str]) -> dict[str, Any]:
    return {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {k: {"type": t, "description": d} for k, (t, d) in props.items()},
        "required": required}}


TOOLS: dict[str, dict[str, Any]] = {
    "get_weather": _fn("get_weather", "Get the current weather for a city.",
                       {"city": ("string", "City name"), "unit": ("string", "celsius or fahrenheit")}, ["city"]),
    "search_web": _fn("search_web", "Search the web and return the top results.",
                      {"query": ("string", "Search query"), "num_results": ("integer", "How many results")},
                      ["query"]),
    "send_email": _fn("send_email", "Send an email.", {"to": ("string", "Recipient address"),
                      "subject": ("string", "Subject line"), "body": ("string", "Message body")},
                      ["to", "subject", "body"]),
    "create_event": _fn("create_event", "Add an event to the calendar.",
                        {"title": ("string", "Event title"), "date": ("string", "YYYY-MM-DD"),
                         "time": ("string", "HH:MM")}, ["title", "date"]),
    "calculator": _fn("calculator", "Evaluate an arithmetic expression.",
                      {"expression": ("string", "Expression to evaluate")}, ["expression"]),
    "get_stock_price": _fn("get_stock_price", "Get the latest price of a stock.",
                           {"ticker": ("string", "Ticker symbol")}, ["ticker"]),
    "read_file": _fn("read_file", "Read a file from the workspace.", {"path": ("string", "File path")}, ["path"]),
    "run_sql": _fn("run_sql", "Run a read-only SQL query.", {"query": ("string", "SQL query")}, ["query"]),
    "translate": _fn("translate", "Translate text.", {"text": ("string", "Text"),
                     "target_language": ("string", "Language to translate into")}, ["text", "target_language"]),
}

TICKERS = ["AAPL", "MSFT", "NVDA", "TSLA", "AMZN", "GOOG"]
FILES = ["src/main.py", "README.md", "config/settings.yaml", "tests/test_api.py", "package.json"]

TOOL_REQUESTS: dict[str, list[Callable[[random.Random], str]]] = {
    "get_weather": [lambda r: f"What's the weather like in {r.choice(CITIES)} right now?",
                    lambda r: f"Do I need an umbrella in {r.choice(CITIES)} today?"],
    "search_web": [lambda r: f"Search the web for recent news about {r.choice(['solar power', 'AI chips', 'rail'])}.",
                   lambda r: f"Find me {r.randint(2, 5)} articles about {r.choice(JOBS)} salaries."],
    "send_email": [lambda r: f"Email {r.choice(NAMES).split()[0].lower()}@example.com that the meeting moved to "
                             f"{r.randint(1, 5)} pm.",
                   lambda r: f"Send a thank-you email to {r.choice(NAMES).split()[0].lower()}@example.com."],
    "create_event": [lambda r: f"Put 'dentist' on my calendar for 2025-0{r.randint(1, 9)}-1{r.randint(0, 9)} at "
                               f"{r.randint(9, 17)}:00.",
                     lambda r: f"Schedule a call with {r.choice(NAMES)} next Friday."],
    "calculator": [lambda r: f"What is {r.randint(100, 999)} * {r.randint(10, 99)}? Use the calculator.",
                   lambda r: f"Calculate {r.randint(1000, 9999)} / {r.randint(2, 40)} for me."],
    "get_stock_price": [lambda r: f"How is {r.choice(TICKERS)} trading today?",
                        lambda r: f"Get me the current price of {r.choice(TICKERS)}."],
    "read_file": [lambda r: f"Open {r.choice(FILES)} and tell me what it does.",
                  lambda r: f"Show me the contents of {r.choice(FILES)}."],
    "run_sql": [lambda r: f"How many {r.choice(['users', 'orders', 'invoices'])} were created last month?",
                lambda r: f"List the top {r.randint(3, 10)} customers by revenue."],
    "translate": [lambda r: f"Translate 'where is the station?' into {r.choice(['French', 'German', 'Japanese'])}.",
                  lambda r: f"How do you say 'thank you very much' in {r.choice(['Spanish', 'Italian'])}?"],
}


def tool_result(name: str, r: random.Random) -> dict[str, Any]:
    """A plausible result for ``name``, so the second turn has something to report."""
    if name == "get_weather":
        return {"temperature": r.randint(-5, 35), "condition": r.choice(["sunny", "rain", "cloudy", "snow"])}
    if name == "search_web":
        return {"results": [{"title": f"Result {i + 1}", "url": f"https://example.com/{i}"} for i in range(3)]}
    if name in ("send_email", "create_event"):
        return {"status": "ok", "id": r.randint(1000, 9999)}
    if name == "calculator":
        return {"result": r.randint(1000, 99999)}
    if name == "get_stock_price":
        return {"price": round(r.uniform(50, 900), 2), "currency": "USD"}
    if name == "read_file":
        return {"content": "def main():\n    print('hello')\n"}
    if name == "run_sql":
        return {"rows": [[r.randint(1, 500)]], "columns": ["count"]}
    return {"translation": "..."}
