"""The self-distillation prompt set: a large, seeded, diverse stream of conversations.

Draft heads (EAGLE section 4.3) and diffusion twins both learn from the target's
own answers, so the data should look like the server's traffic:

  - chat (advice, explanations, creative writing), with many styles and audiences;
  - code: write, fix, explain, translate, and edits that reproduce most of the input
    (the repetitive agentic traffic where drafting pays most);
  - JSON extraction from given text, over several record shapes;
  - tool calls: 1-3 function tools rendered the way the server renders them, and a
    second turn that answers the model's own call with a tool result;
  - multi-turn: a follow-up user turn after the model's own first answer;
  - summaries of generated notes, emails and reports; arithmetic word problems;
  - the templated kinds of ``eagle_prompts`` and the exact-answer kinds of ``diffusion_data``.

Conversation i depends only on (seed, i): ``conversation(seed, i)`` draws from its
own ``random.Random``, so the set is unbounded and any prefix is reproducible and
resumable by index. Prompts equal to (or containing) a held-out evaluation prompt,
``clients/prompts/*.jsonl``, are rejected where they are made, so held-out text
never reaches training (``HeldOut``).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .diffusion_data import EXACT_KINDS
from .eagle_prompts import ACTIVITIES, AUDIENCES, CITIES, CODE_TASKS, ITEMS, JOBS, KINDS, LANGUAGES, NAMES, TOPICS
from .distil_snippets import CODE_SNIPPETS, FOLLOWUPS, PEOPLE_FACTS, TOOLS, TOOL_REQUESTS, tool_result

Message = dict[str, Any]


@dataclass(frozen=True)
class Conversation:
    """One prompt: the first user messages, and for two-turn kinds the message after the model's answer."""

    kind: str
    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    followup: Message | None = None   # role "user" or "tool"; sent after the model's first answer

    @property
    def turns(self) -> int:
        return 1 if self.followup is None else 2

    def texts(self) -> list[str]:
        out = [m["content"] for m in self.messages if m.get("content")]
        return out + ([self.followup["content"]] if self.followup else [])


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


@dataclass
class HeldOut:
    """Evaluation prompts that training must never see: exact (normalised) matches and containment."""

    prompts: set[str] = field(default_factory=set)

    @classmethod
    def from_files(cls, paths: list[Path]) -> "HeldOut":
        out = set()
        for path in paths:
            for line in path.read_text().splitlines():
                if line.strip():
                    out.add(_norm(json.loads(line)["prompt"]))
        return cls(out)

    def overlaps(self, text: str) -> bool:
        """``text`` contains a held-out prompt ("What is 42 + 23? Answer with just the number." holds
        "What is 42 + 23?"), or is a long part of one (the passage of a held-out summary)."""
        t = _norm(text)
        return any(p in t or (len(t) >= 40 and t in p) for p in self.prompts)


def default_held_out(repo_root: Path | None = None) -> HeldOut:
    root = repo_root or Path(__file__).resolve().parents[2]
    return HeldOut.from_files(sorted((root / "clients" / "prompts").glob("*.jsonl")))


# ---- kinds -----------------------------------------------------------------------

STYLES = ["", " Keep it under 100 words.", " Use bullet points.", " Be concise.", " Explain like I'm new to this.",
          " Give one concrete example.", " Answer in two short paragraphs.", " Use a numbered list."]
CREATIVE = ["a haiku", "a limerick", "a four-line poem", "a short story opening", "a product description",
            "a tweet", "a thank-you note", "a motivational quote", "a riddle", "a short dialogue"]
SUBJECTS = ["a lighthouse keeper", "a lost umbrella", "the first day of spring", "a robot learning to cook",
            "a rainy train station", "an old library", "a cat who hates Mondays", "a mountain village",
            "a detective dog", "a bakery at dawn", "a forgotten password", "the last bus home"]


def chat(r: random.Random) -> Conversation:
    t = r.choice([
        "How do I get started with {act}?", "What mistakes do people make when {act}?",
        "Compare {topic} and {topic2} for {aud}.", "Explain how {topic} works.",
        "Why do people care about {topic}?", "Write {creative} about {subject}.",
        "I'm {aud2}. Teach me the basics of {topic}.", "What should I know before {act}?",
        "Give me a weekly schedule for {act}.", "Describe {subject} in vivid detail.",
        "What would happen if {topic} disappeared tomorrow?", "Suggest five names for {subject}.",
    ])
    text = t.format(act=r.choice(ACTIVITIES), topic=r.choice(TOPICS), topic2=r.choice(TOPICS),
                    aud=r.choice(AUDIENCES), aud2=r.choice(["a student", "a retiree", "a nurse", "a teenager",
                                                            "a software developer", "a new parent"]),
                    creative=r.choice(CREATIVE), subject=r.choice(SUBJECTS))
    return Conversation("chat", [{"role": "user", "content": text + r.choice(STYLES)}])


NEW_NAMES = ["compute", "helper", "process_items", "run", "calc", "handle", "apply_rule", "transform"]
EDITS = ["Rename every variable to a more descriptive name.", "Convert the loop into a comprehension or map.",
         "Add logging at the start and end.", "Make the function handle an empty input.",
         "Add a comment above each line.", "Change the indentation to tabs.", "Make it a method of a class.",
         "Add input validation.", "Reformat this code in the project's style.", "Add a main guard that calls it."]


def code(r: random.Random) -> Conversation:
    lang, task = r.choice(LANGUAGES), r.choice(CODE_TASKS)
    snippet_lang, snippet = r.choice(CODE_SNIPPETS)
    name = re.search(r"def (\w+)|function (\w+)", snippet)
    fn = next(g for g in name.groups() if g) if name else "f"
    text = r.choice([
        f"Write a {lang} function that {task}.",
        f"Write a {lang} program that {task}, with comments.",
        f"Here is some {snippet_lang} code:\n\n```\n{snippet}\n```\n\nExplain what it does.",
        f"Find and fix any bug in this {snippet_lang} code:\n\n```\n{snippet}\n```",
        f"Rename `{fn}` to `{r.choice(NEW_NAMES)}` in this code and return the full code:\n\n```\n{snippet}\n```",
        f"{r.choice(EDITS)} Return the full code.\n\n```\n{snippet}\n```",
        f"Add type hints and a docstring to this code, and return the whole file:\n\n```\n{snippet}\n```",
        f"Translate this {snippet_lang} code into {lang}:\n\n```\n{snippet}\n```",
        f"Write unit tests for this function:\n\n```\n{snippet}\n```",
        f"Add error handling to this code and return the complete updated version:\n\n```\n{snippet}\n```",
        f"What is the time complexity of this code?\n\n```\n{snippet}\n```",
    ])
    return Conversation("code", [{"role": "user", "content": text}])


def json_extraction(r: random.Random) -> Conversation:
    fact = r.choice(PEOPLE_FACTS)(r)
    text, keys = fact
    text = r.choice([
        f"Extract {', '.join(keys)} from the text below as JSON.\n\nText: {text}",
        f"Return only a JSON object with keys {', '.join(json.dumps(k) for k in keys)}.\n\n{text}",
        f"Parse this into JSON ({', '.join(keys)}):\n{text}",
        f"Read the following and output a JSON object. Use null for anything missing.\nKeys: {', '.join(keys)}\n"
        f"Text: {text}",
    ])
    return Conversation("json", [{"role": "user", "content": text}])


def tool_call(r: random.Random) -> Conversation:
    """1-3 tools, a request for one of them; the second turn answers the model's call with a result."""
    names = list(TOOLS)
    chosen = r.choice(names)
    others = r.sample([n for n in names if n != chosen], r.randint(0, 2))
    order = [chosen, *others]
    r.shuffle(order)
    tools = [{"type": "function", "function": TOOLS[n]} for n in order]
    request = r.choice(TOOL_REQUESTS[chosen])(r)
    messages = [{"role": "user", "content": request}]
    if r.random() < 0.3:
        messages.insert(0, {"role": "system", "content": r.choice(
            ["You are a helpful assistant.", "You are a concise assistant with access to tools.",
             "Answer the user's questions, calling tools when needed."])})
    followup = {"role": "tool", "content": json.dumps(tool_result(chosen, r))}
    return Conversation("tool_call", messages, tools, followup)


def multi_turn(r: random.Random) -> Conversation:
    first = r.choice([chat, code, json_extraction, summary, arithmetic])(r)
    return Conversation("multi_turn", first.messages, None, {"role": "user", "content": r.choice(FOLLOWUPS)})


def summary(r: random.Random) -> Conversation:
    name, other, city, job = r.choice(NAMES), r.choice(NAMES), r.choice(CITIES), r.choice(JOBS)
    n, item, day = r.randint(2, 40), r.choice(ITEMS), r.choice(["Monday", "Tuesday", "Thursday", "Friday"])
    passage = r.choice([
        f"Meeting notes ({day}): {name} opened by reviewing last quarter. Sales of {item} rose by {n}% in "
        f"{city}, but delivery times slipped. {other} proposed hiring a second {job}. The team agreed to "
        f"revisit the budget next week and to ask finance for updated numbers.",
        f"Hi team, quick update from {name}. The {city} office will close early on {day} for maintenance. "
        f"Please save your work and take your laptops home. {other} will send the new badge process, and "
        f"anyone who needs a desk on {day} should book one in the {r.choice(CITIES)} office.",
        f"Incident report: on {day} the ordering system was down for {n} minutes after a database update. "
        f"{name}, the on-call {job}, rolled the change back. No orders were lost. {other} will add a test so "
        f"the same update cannot ship again.",
        f"{name} has worked as a {job} in {city} for {n} years. Last year they started a weekend course on "
        f"{r.choice(TOPICS)}, and now they teach it to {r.randint(5, 30)} students. {other}, a colleague, "
        f"says the course changed how the whole team works.",
        f"Customer review: I ordered {n} {item} on {day}. The delivery to {city} was fast, but two arrived "
        f"damaged. Support replied within an hour and sent replacements. I would buy again, though the "
        f"packaging needs work.",
    ])
    text = r.choice([
        f"Summarize this in one sentence:\n\n{passage}", f"Give three bullet points summarizing:\n\n{passage}",
        f"What are the action items in this text?\n\n{passage}", f"Write a short title for:\n\n{passage}",
        f"Summarize for a busy manager:\n\n{passage}", f"TL;DR:\n\n{passage}",
    ])
    return Conversation("summary", [{"role": "user", "content": text}])


def arithmetic(r: random.Random) -> Conversation:
    a, b, c = r.randint(2, 500), r.randint(2, 99), r.randint(2, 20)
    item, name = r.choice(ITEMS), r.choice(NAMES).split()[0]
    text = r.choice([
        f"What is {a} + {b} * {c}? Show each step.", f"Compute ({a} - {b}) * {c}.",
        f"{name} buys {c} {item} at ${b / 4:.2f} each. What is the total?",
        f"Round {a / c:.4f} to two decimal places.", f"What is {c}% of {a}?",
        f"A recipe needs {c} eggs for {b % 8 + 2} people. How many eggs for {a % 20 + 3} people?",
        f"Convert {a} minutes into hours and minutes.", f"Is {a} a prime number? Explain.",
        f"{name} saves ${b} a week. How many weeks to save ${a * 3}?",
        f"What is the average of {a}, {b} and {c}?", f"Solve for x: {c}x + {b} = {a}.",
    ])
    return Conversation("arithmetic", [{"role": "user", "content": text}])


def templated(r: random.Random) -> Conversation:
    """The older template kinds (``eagle_prompts``) and exact-answer kinds (``diffusion_data``)."""
    kinds: list[Callable[[random.Random], str]] = [*KINDS.values(), *EXACT_KINDS.values()]
    return Conversation("templated", [{"role": "user", "content": r.choice(kinds)(r)}])


# Weights: the agentic kinds (code edits, JSON, tools) and multi-turn get a large share on purpose.
MIX: list[tuple[Callable[[random.Random], Conversation], int]] = [
    (chat, 20), (code, 18), (json_extraction, 12), (tool_call, 14), (multi_turn, 14),
    (summary, 8), (arithmetic, 8), (templated, 6)]


def conversation(seed: int, index: int, held_out: HeldOut) -> Conversation:
    """Conversation ``index`` of the set ``seed``; redraws (deterministically) on a held-out overlap."""
    for attempt in range(100):
        r = random.Random(f"{seed}:{index}:{attempt}")
        make = r.choices([m for m, _ in MIX], weights=[w for _, w in MIX])[0]
        conv = make(r)
        if not any(held_out.overlaps(t) for t in conv.texts()):
            return conv
    raise RuntimeError(f"conversation {index} overlaps the held-out prompts on every draw")


def file_conversations(path: Path, held_out: HeldOut) -> list[Conversation]:
    """The conversations of a JSONL prompt file, in file order, held-out overlaps dropped.

    A line is ``{"prompt": str}`` or ``{"messages": [...]}`` (OpenAI chat messages), with optional
    ``"kind"`` and ``"tools"``: for instance the requests a deployment actually serves, so that a draft
    model learns the answers its users get rather than those to the generated set.
    """
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            messages = rec["messages"] if "messages" in rec else [{"role": "user", "content": str(rec["prompt"])}]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{n}: not a prompt line ({{\"prompt\": ...}} or {{\"messages\": [...]}}): {e}")
        conv = Conversation(str(rec.get("kind", "file")), messages, rec.get("tools"))
        if not any(held_out.overlaps(t) for t in conv.texts() if isinstance(t, str)):
            out.append(conv)
    return out


def signature(conv: Conversation) -> str:
    """Identity of a conversation: greedy answers to equal conversations are equal, so the job skips repeats."""
    return json.dumps([conv.messages, conv.tools, conv.followup], sort_keys=True)
