"""``clients/eval_twin``: the agreement measures, and one small run on the default model and its twin."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dualserve.clients import eval_twin
from dualserve.clients.eval_twin import Run, prefix_agreement, summarize, token_f1


def test_token_f1_and_prefix_agreement() -> None:
    assert token_f1([1, 2, 3], [1, 2, 3]) == 1.0
    assert token_f1([], []) == 1.0 and token_f1([1], []) == 0.0 and token_f1([1, 2], [3]) == 0.0
    # shared {1, 2} (a repeated token counts as often as both hold it): p = 2/4, r = 2/3
    assert token_f1([1, 2, 3], [2, 1, 1, 4]) == pytest.approx(2 * 0.5 * (2 / 3) / (0.5 + 2 / 3))
    assert prefix_agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 0.5
    # the same words after an early difference: no prefix credit, full F1
    assert prefix_agreement([5, 6, 7], [6, 5, 7]) == 0.0 and token_f1([5, 6, 7], [6, 5, 7]) == 1.0


def test_summary_scores_exact_answers_and_free_form_agreement() -> None:
    items = [{"id": "a", "kind": "fact", "check": "contains", "answer": "paris"},
             {"id": "b", "kind": "math", "check": "number", "answer": "4"}]
    free = [{"id": "c", "kind": "chat", "check": "free"}]
    ar = Run("ar", "ar", outputs={"a": [1, 2], "b": [3], "c": [7, 8, 9, 10]},
             texts={"a": "Paris.", "b": "It is 5.", "c": "hello"}, tokens=7, forwards=7, seconds=1.0)
    twin = Run("diffusion tau=0.9", "diffusion", 0.9, outputs={"a": [1, 2], "b": [3], "c": [7, 9, 8, 10]},
               texts={"a": "Paris.", "b": "It is 4.", "c": "hello"}, tokens=7, forwards=2, seconds=0.5)
    s = summarize(items, [ar, twin], free)
    assert (s["items"], s["scored"], s["free_form"]) == (2, 1, 1)  # AR got the arithmetic wrong: not scored
    row = s["rows"][1]
    assert row["exact_match"] == 1.0 and row["quality_vs_ar"] == 1.0 and row["identical_to_ar"] == 1.0
    assert row["free_identical_to_ar"] == 0.0 and row["free_prefix_agreement"] == 0.25
    assert row["free_token_f1"] == 1.0
    assert row["tokens_per_forward"] == 3.5 and row["speed_vs_ar"] == 2.0


def test_eval_twin_runs_on_the_default_model(default_gguf: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "summary.json"
    assert eval_twin.main(["--limit", "2", "--free-form-limit", "2", "--max-tokens", "8", "--taus", "0.9",
                           "--threads", "1", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert (summary["items"], summary["free_form"]) == (2, 2)
    runs = {r["run"]: r for r in summary["rows"]}
    assert set(runs) == {"ar", "eagle", "diffusion tau=0.9"}
    assert runs["ar"]["free_token_f1"] == 1.0 and runs["ar"]["identical_to_ar"] == 1.0
    assert runs["eagle"]["free_identical_to_ar"] == 1.0  # lossless
    assert runs["diffusion tau=0.9"]["tokens_per_forward"] >= 1.0
    assert "free_token_f1" in capsys.readouterr().out
