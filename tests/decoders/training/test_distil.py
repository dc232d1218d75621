"""Self-distillation job: held-out prompts never appear, shards resume without redoing finished prompts."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from dualserve.decoders.training.distil import JobSpec, Settings, distil, looping, read_records
from dualserve.decoders.training.distil_prompts import (HeldOut, conversation, default_held_out, file_conversations,
                                                        signature)
from dualserve.models.loader import load_model
from tiny_twin import write_tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


def test_prompt_set_is_seeded_diverse_and_holds_out_evaluation_prompts() -> None:
    held = default_held_out()
    assert len(held.prompts) > 50
    convs = [conversation(0, i, held) for i in range(600)]
    assert [signature(c) for c in convs[:20]] == [signature(conversation(0, i, held)) for i in range(20)]
    assert {"chat", "code", "json", "tool_call", "multi_turn", "summary", "arithmetic"} <= {c.kind for c in convs}
    assert len({signature(c) for c in convs}) > 500
    for c in convs:
        assert not any(held.overlaps(t) for t in c.texts())
    tools = next(c for c in convs if c.kind == "tool_call")
    assert tools.tools and tools.followup["role"] == "tool"
    # A held-out prompt is never produced: make one of the set's own prompts held out and redraw.
    text = convs[0].messages[-1]["content"]
    redrawn = conversation(0, 0, HeldOut({" ".join(text.split()).lower()}))
    assert text not in redrawn.texts()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama"))


def test_distil_writes_shards_and_resume_skips_finished(tiny, tmp_path: Path) -> None:
    settings = Settings(seed=0, temperature=0.0, max_new_tokens=6, max_prompt_len=4096, model=tiny.name,
                        quantization=tiny.quantization)
    run = lambda n: distil(tiny, tmp_path, JobSpec(settings, 10**9, 4, max_conversations=n), lambda m: None)
    with torch.inference_mode():
        first = run(5)
        recs = list(read_records(tmp_path))
        assert first["records"] == len(recs) and first["answer_tokens"] == sum(len(r["answer_ids"]) for r in recs)
        assert {r["index"] for r in recs} == set(range(5)) - dup_indices(5)
        for r in recs:
            assert r["prompt_ids"] and 1 <= len(r["answer_ids"]) <= 6 and r["settings"] == settings.key
            assert r["temperature"] == 0.0 and r["finish"] in ("stop", "length")
        twice = [r for r in recs if r["turn"] == 2]
        assert twice  # conversation 4 is a tool call, answered with a tool result in turn 2
        for r in twice:  # turn 2's prompt holds turn 1's prompt
            one = next(x for x in recs if x["index"] == r["index"] and x["turn"] == 1)
            assert r["prompt_ids"][:len(one["prompt_ids"])] == one["prompt_ids"]

        # An interrupted write leaves a torn line; the reader skips it and resume redoes nothing.
        shard = sorted(tmp_path.glob("shard-*.jsonl"))[-1]
        with shard.open("a") as f:
            f.write('{"index": 99, "tu')
        again = run(5)
        assert again["records"] == len(recs) and list(read_records(tmp_path)) == recs

        more = run(8)
        new = list(read_records(tmp_path))
        assert new[:len(recs)] == recs
        assert {r["index"] for r in new[len(recs):]} == set(range(5, 8)) - dup_indices(8)
        assert not [k for k, v in Counter((r["index"], r["turn"]) for r in new).items() if v > 1]
        manifest = json.loads((tmp_path / "manifest.json").read_text())
        assert manifest["records"] == more["records"] == len(new)
        assert manifest["settings"] == {settings.key: settings.as_dict()}

    other = Settings(**{**settings.as_dict(), "temperature": 0.7})
    with pytest.raises(SystemExit):
        distil(tiny, tmp_path, JobSpec(other, 10**9, 4, max_conversations=1), lambda m: None)


def test_a_prompt_file_is_answered_in_order_without_its_held_out_lines(tiny, tmp_path: Path) -> None:
    held = default_held_out()
    lines = [{"prompt": "How do I keep basil alive on a windowsill?"},
             {"prompt": next(iter(held.prompts))},  # a held-out prompt: dropped
             {"kind": "code", "messages": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Reverse a list in Python."}]},
             {"prompt": "Name three uses for baking soda."}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    convs = file_conversations(path, held)
    assert [c.kind for c in convs] == ["file", "code", "file"]
    assert convs[1].messages == lines[2]["messages"]
    settings = Settings(seed=0, temperature=0.0, max_new_tokens=4, max_prompt_len=4096, model=tiny.name,
                        quantization=tiny.quantization, prompts="abc")
    assert settings.key != Settings(**{**settings.as_dict(), "prompts": ""}).key
    out = tmp_path / "out"
    with torch.inference_mode():
        manifest = distil(tiny, out, JobSpec(settings, 10**9, 4, held, conversations=convs), lambda m: None)
    recs = list(read_records(out))
    assert manifest["records"] == 3 and [r["index"] for r in sorted(recs, key=lambda r: r["index"])] == [0, 1, 2]
    assert manifest["prompt_set"] == {"file_sha1": "abc"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        file_conversations(bad, held)


def test_generated_set_settings_keep_their_key() -> None:
    """A field added for prompt files leaves the generated set's key (and so its existing data) as it was."""
    settings = Settings(seed=0, temperature=0.0, max_new_tokens=400, max_prompt_len=1536,
                        model="SmolLM2-135M-Instruct", quantization="int4", loop_window=96)
    assert "prompts" not in settings.as_dict() and settings.key == "ffd7656b4f"


def dup_indices(n: int) -> set[int]:
    seen, dups = set(), set()
    for i in range(n):
        s = signature(conversation(0, i, HeldOut()))
        (dups.add(i) if s in seen else seen.add(s))
    return dups


def test_looping_answers_are_detected_once_two_cycles_are_in() -> None:
    cycle = [5, 9, 7, 3]
    assert looping([1, 2, 3] + cycle * 6, window=8)
    assert looping([1, 2, 3] + cycle * 2, window=8)           # two full cycles: enough
    assert not looping([1, 2, 3, 4] + cycle + [6, 8, 1], window=8)
    assert not looping(list(range(40)), window=8)
    assert not looping([1, 2, 3] + cycle * 6, window=0)       # off


def test_a_looping_answer_is_cut_and_kept(tiny, tmp_path: Path) -> None:
    settings = Settings(seed=0, temperature=0.0, max_new_tokens=40, max_prompt_len=4096, model=tiny.name,
                        quantization=tiny.quantization, loop_window=6)
    with torch.inference_mode():
        distil(tiny, tmp_path, JobSpec(settings, 10**9, 4, max_conversations=4), lambda m: None)
    recs = list(read_records(tmp_path))
    cut = [r for r in recs if r["finish"] == "loop"]
    assert cut, [r["answer_ids"] for r in recs]  # the tiny random model falls into loops
    for r in cut:
        assert len(r["answer_ids"]) < 40 and looping(r["answer_ids"], 6)
