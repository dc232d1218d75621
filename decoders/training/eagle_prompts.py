"""A varied prompt set for self-distilling EAGLE heads, built from templates.

A draft head learns to predict what *its* target says, so the training data is
the target's own answers (EAGLE paper, section 4.3: a fixed dataset works, the
target's own outputs work better). What matters is coverage of the kinds of
requests the server sees: chat, code, extraction into JSON, summarisation,
arithmetic and factual reasoning. Each kind is a list of templates and slot
fillers; a seeded RNG combines them, so the set is reproducible and has no
overlap with ``clients/prompts/bench.jsonl`` unless that file is added on purpose.
"""

from __future__ import annotations

import random

TOPICS = ["photosynthesis", "black holes", "the French Revolution", "compound interest", "vaccines",
          "machine learning", "climate change", "the immune system", "plate tectonics", "inflation",
          "the printing press", "electric cars", "volcanoes", "the water cycle", "DNA", "blockchains",
          "the Roman Empire", "solar panels", "sleep", "coffee", "the stock market", "recycling",
          "gravity", "the internet", "bees", "antibiotics", "rainbows", "the moon landing", "democracy",
          "earthquakes", "nutrition", "jazz music", "the Olympics", "chess", "honey", "glaciers"]
ACTIVITIES = ["learning a new language", "saving money", "running a marathon", "cooking for a party",
              "studying for exams", "starting a garden", "working from home", "travelling on a budget",
              "learning to draw", "getting better sleep", "public speaking", "moving to a new city",
              "starting a small business", "learning the guitar", "reading more books", "staying focused"]
AUDIENCES = ["a five-year-old", "a high school student", "a busy manager", "my grandmother", "a beginner",
             "an engineer"]
LANGUAGES = ["Python", "JavaScript", "Rust", "Go", "C", "Java", "TypeScript", "Bash", "SQL"]
CODE_TASKS = ["reverses a linked list", "checks whether a number is prime", "counts the words in a string",
              "merges two sorted lists", "computes the factorial of n", "finds the largest element in a list",
              "removes duplicates from a list while keeping order", "converts Celsius to Fahrenheit",
              "returns the n-th Fibonacci number", "validates an email address",
              "flattens a nested list", "computes the average of a list of numbers",
              "sorts a list of names alphabetically", "reads a file and counts its lines",
              "checks whether two strings are anagrams", "implements binary search",
              "capitalizes the first letter of each word", "sums the digits of an integer"]
NAMES = ["Alice Martin", "Bob Chen", "Carla Diaz", "David Okafor", "Emma Novak", "Farid Haddad", "Grace Kim",
         "Hugo Laurent", "Ines Silva", "Jonas Berg", "Keiko Tanaka", "Liam Walsh", "Maya Patel"]
CITIES = ["Paris", "Lagos", "Osaka", "Toronto", "Berlin", "Lima", "Cairo", "Sydney", "Oslo", "Madrid", "Seoul"]
JOBS = ["nurse", "software engineer", "teacher", "chef", "architect", "pilot", "accountant", "farmer"]
ITEMS = ["apples", "pencils", "notebooks", "tickets", "oranges", "books", "cupcakes", "bottles of water"]
PASSAGES = [
    "The city council met on Monday to discuss the new bike lanes. Supporters said the lanes would reduce "
    "traffic and pollution, while some shop owners worried about losing parking spaces. The council voted "
    "to test the lanes for six months before making a final decision.",
    "Researchers found that people who walked for thirty minutes a day slept better and reported less "
    "stress. The study followed 2,000 adults for one year. The effect was strongest for people who walked "
    "outdoors in the morning.",
    "The company reported record sales in the third quarter, driven by strong demand for its new phone. "
    "However, profits fell slightly because of higher costs for parts and shipping. The chief executive "
    "said prices would stay the same for now.",
    "After a dry summer, the lake reached its lowest level in forty years. Local farmers have been asked to "
    "reduce water use, and boat trips have been cancelled. Officials hope autumn rains will refill it.",
    "The museum opened a new exhibition on ancient Egypt, featuring more than 300 objects, including "
    "jewelry, tools and a painted coffin. Visitors can also try an interactive map of the Nile valley.",
    "A small startup built a drone that plants tree seeds from the air. In tests, it planted 40,000 seeds "
    "in a single day. Critics say many seeds will not survive without care on the ground.",
]


def _chat(r: random.Random) -> str:
    t = r.choice([
        "Can you give me some tips for {act}?",
        "Explain {topic} to {aud}.",
        "What are the pros and cons of {act}?",
        "Write a short poem about {topic}.",
        "I want to get better at {act}. Where should I start?",
        "Tell me three interesting facts about {topic}.",
        "Write a friendly message inviting a friend to try {act} with me.",
        "Why is {topic} important? Keep it short.",
        "Give me a step-by-step plan for {act} over the next month.",
        "What is a common misconception about {topic}?",
    ])
    return t.format(act=r.choice(ACTIVITIES), topic=r.choice(TOPICS), aud=r.choice(AUDIENCES))


def _code(r: random.Random) -> str:
    t = r.choice([
        "Write a {lang} function that {task}.",
        "Write a {lang} function that {task}. Add a short docstring or comment.",
        "How would you write code in {lang} that {task}? Show the code and explain it briefly.",
        "Write a unit test for a function that {task}, in {lang}.",
        "Explain what a {lang} function that {task} would look like, then write it.",
    ])
    return t.format(lang=r.choice(LANGUAGES), task=r.choice(CODE_TASKS))


def _extraction(r: random.Random) -> str:
    name, city, job = r.choice(NAMES), r.choice(CITIES), r.choice(JOBS)
    age = r.randint(19, 78)
    text = r.choice([
        f"{name} is a {age}-year-old {job} who lives in {city}.",
        f"Yesterday I met {name}, a {job} from {city}. They told me they are {age} years old.",
        f"Our new {job}, {name} (age {age}), is moving to {city} next month.",
    ])
    return r.choice([
        f"Extract the name, age, job and city from this text as JSON.\n\nText: {text}",
        f"Return a JSON object with keys \"name\", \"age\" and \"city\" for this sentence: {text}",
        f"Read the text and output only JSON with the person's details.\n\n{text}",
    ])


def _summary(r: random.Random) -> str:
    passage = r.choice(PASSAGES)
    return r.choice([
        f"Summarize the following text in one sentence.\n\n{passage}",
        f"Give three bullet points summarizing this:\n\n{passage}",
        f"What is the main point of this paragraph?\n\n{passage}",
        f"Write a short headline for this news story.\n\n{passage}",
    ])


def _reasoning(r: random.Random) -> str:
    a, b, c = r.randint(2, 12), r.randint(2, 30), r.randint(2, 20)
    item = r.choice(ITEMS)
    return r.choice([
        f"If {a} {item} cost {b} dollars, how much do {c} {item} cost? Explain step by step.",
        f"A shop sells {item} in packs of {a}. How many packs do I need for {a * c + r.randint(1, a - 1)} {item}?",
        f"What is {a * b} divided by {a}? Show your work.",
        f"A train travels {b * 10} km in {a} hours. What is its average speed?",
        f"Tom has {b} {item}. He gives {min(c, b)} to his sister. How many does he have left?",
        f"What is {b}% of {c * 20}? Explain.",
    ])


def _factual(r: random.Random) -> str:
    return r.choice([
        "What is the capital of {city_country}?", "Who invented {invention}?",
        "When did {event} happen?", "What is {topic} in simple terms?",
    ]).format(city_country=r.choice(["France", "Japan", "Canada", "Brazil", "Kenya", "Norway", "Egypt"]),
              invention=r.choice(["the telephone", "the light bulb", "the airplane", "penicillin"]),
              event=r.choice(["the first moon landing", "the fall of the Berlin Wall", "World War I"]),
              topic=r.choice(TOPICS))


KINDS = {"chat": _chat, "code": _code, "extraction": _extraction, "summarisation": _summary,
         "reasoning": _reasoning, "factual": _factual}


def build_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct prompts, cycling through the kinds so each gets an equal share."""
    r = random.Random(seed)
    kinds = list(KINDS.values())
    out: list[str] = []
    seen: set[str] = set()
    attempts = 0
    while len(out) < n and attempts < 50 * n:
        p = kinds[attempts % len(kinds)](r)
        attempts += 1
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out
