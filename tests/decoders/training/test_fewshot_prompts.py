"""Few-shot prompt writing against the served default model, through the real openai SDK."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from dualserve.decoders.training.distil_prompts import default_held_out
from dualserve.decoders.training.fewshot_prompts import SEEDS, WEIGHTS, generate, main, message, request


def test_requests_are_seeded_and_show_four_seed_messages_of_one_kind() -> None:
    assert request(3, 17) == request(3, 17) and request(3, 17) != request(4, 17)
    kinds = {request(0, i)[0] for i in range(200)}
    assert kinds == set(WEIGHTS)
    kind, opener, prompt = request(0, 5)
    shown = [json.loads(line)["message"] for line in prompt.splitlines()[2:-1]]
    assert len(shown) == 4 and set(shown) <= set(SEEDS[kind]) and prompt.endswith('{"message": "' + opener)
    held = default_held_out()
    assert not [q for qs in SEEDS.values() for q in qs if held.overlaps(q)]


def test_the_sampled_line_is_read_up_to_its_closing_quote() -> None:
    assert message("Extract ", r'the name as JSON: \"Ann\""}' + "\n{") == 'Extract the name as JSON: "Ann"'
    assert message("", "How do I fix a leaking tap?\"}") == "How do I fix a leaking tap?"
    assert message("", "an unclosed line") is None


def test_generate_writes_new_messages_and_appends_without_repeats(server_url: str, tmp_path: Path) -> None:
    out = tmp_path / "prompts.jsonl"
    first = asyncio.run(generate(f"{server_url}/v1", 24, out, seed=0, concurrency=8, temperature=0.9))
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert first == len(lines) > 0
    assert all(r["kind"] in WEIGHTS and len(r["prompt"]) >= 15 for r in lines)
    held = default_held_out()
    assert not [r for r in lines if held.overlaps(r["prompt"])]
    again = asyncio.run(generate(f"{server_url}/v1", 24, out, seed=1, concurrency=8, temperature=0.9))
    more = [json.loads(line)["prompt"] for line in out.read_text().splitlines()]
    assert more[:len(lines)] == [r["prompt"] for r in lines] and again == len(more)
    keys = [" ".join(p.split()).lower() for p in more]
    assert len(set(keys)) == len(keys)


def test_an_unreachable_server_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--url", "http://127.0.0.1:9/v1", "--requests", "2", "--out", str(tmp_path / "p.jsonl")])
    assert str(e.value).startswith("fewshot_prompts: http://127.0.0.1:9/v1: ") and "\n" not in str(e.value)
