"""``clients/eval_fidelity``: a whole run on a tiny Llama (two formats, ``--layers``), the module
swaps, the shipped corpus, and the parts of the llama.cpp path that need no llama.cpp."""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import pytest

from dualserve.clients import eval_fidelity
from dualserve.clients.eval_fidelity import CORPUS, REFERENCE, tokenizer_agreement
from dualserve.clients.fidelity_scores import read_sections, tokenize_corpus
from tiny_twin import WORDS, write_tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("fidelity") / "tiny-llama")


def write_corpus(path: Path) -> Path:
    """Word salad over the tiny vocabulary, and a ChatML section: about 130 tokens."""
    rng = random.Random(0)
    prose = " ".join(rng.choice(WORDS[3:]) for _ in range(80))
    chat = "".join(f"<|im_start|>user\n{rng.choice(WORDS[3:])} {rng.choice(WORDS[3:])}<|im_end|>\n"
                   f"<|im_start|>assistant\n{rng.choice(WORDS[3:])}<|im_end|>\n" for _ in range(8))
    path.write_text(f"%% prose\n{prose}\n\n%% chat\n{chat}")
    return path


def test_run_on_a_tiny_model(tiny_llama: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "fidelity.json"
    corpus = write_corpus(tmp_path / "corpus.txt")
    assert eval_fidelity.main(["--model", str(tiny_llama), "--cache-dir", str(tmp_path / "cache"),
                               "--formats", "int8", "int4", "--corpus", str(corpus), "--ctx", "32",
                               "--layers", "--layer-tokens", "64", "--threads", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert list(rows) == [REFERENCE, "int8", "int4"]
    assert report["corpus"]["chunks"] >= 3 and report["corpus"]["kinds"] == ["prose", "chat"]
    ref = rows[REFERENCE]
    assert ref["kl_mean"] == 0.0 and ref["kl_max"] == 0.0 and ref["top1"] == 1.0
    assert ref["tokens"] == report["corpus"]["chunks"] * 15  # ctx/2 - 1 scored per chunk
    for fmt in ("int8", "int4"):
        assert math.isfinite(rows[fmt]["kl_mean"]) and rows[fmt]["kl_mean"] >= 0.0
        assert 0.0 <= rows[fmt]["top1"] <= 1.0 and rows[fmt]["ppl"] > 1.0
        assert set(rows[fmt]["by_kind"]) == {"prose", "chat"}
        assert report["formats"][fmt]["kv_dtype"] == "bfloat16"
        layers = report["layers"]["formats"][fmt]
        assert [entry["layer"] for entry in layers["layers"]] == [0, 1]  # one entry per layer
        assert all(math.isfinite(entry["mean"]) and entry["mean"] >= 0.0 for entry in layers["layers"])
        assert layers["kinds"]["all"]["kl_mean"] >= 0.0 and "qkv_proj" in layers["kinds"]
    text = capsys.readouterr().out
    assert "| fp32 (reference) | 0.00000 ± 0.00000" in text and "where the error enters" in text


def test_swaps_are_restored_and_keep_a_float_head(tiny_llama: Path, tmp_path: Path) -> None:
    import torch

    from dualserve.clients.fidelity_layers import KINDS, swapped
    from dualserve.models.loader import load_model

    ref = load_model(tiny_llama, cache_dir=tmp_path).model
    fmt = load_model(tiny_llama, cache_dir=tmp_path, quantization="int4").model
    before = dict(ref.named_modules())
    for kind in KINDS:
        with swapped(ref, fmt, kind) as model:
            if kind == "qkv_proj":
                assert all(a.self_attn.qkv_proj is b.self_attn.qkv_proj for a, b in zip(model.layers, fmt.layers))
            if kind == "embed_tokens":  # tied: the head stays the float embedding matrix
                assert model.embed_tokens is fmt.embed_tokens
                assert torch.equal(model.lm_head.weight, before["embed_tokens"].weight)
        assert dict(ref.named_modules()) == before and ref.lm_head is None


def test_shipped_corpus_is_varied_and_chat_uses_special_ids(default_gguf: Path, cache_dir: Path) -> None:
    from dualserve.models.loader import prepare_source
    from dualserve.models.tokenizer import Tokenizer

    kinds = {kind for kind, _ in read_sections(CORPUS)}
    assert {"prose", "fr", "de", "es", "python", "javascript", "sql", "shell", "json", "markdown", "chat"} <= kinds
    tokenizer = Tokenizer.from_hf_dir(prepare_source(default_gguf, cache_dir))
    corpus = tokenize_corpus(tokenizer, CORPUS)
    assert 5000 <= len(corpus.ids) <= 7500
    start, end = tokenizer.token_to_id("<|im_start|>"), tokenizer.token_to_id("<|im_end|>")
    chat = [ids for kind, _, ids in corpus.sections if kind == "chat"]
    assert all(ids[0] == start and ids.count(start) == ids.count(end) > 2 for ids in chat)


def test_tokenizer_agreement_and_a_missing_llama_cpp(monkeypatch) -> None:
    corpus = eval_fidelity.Corpus([1, 2, 3, 4], [0, 0, 1, 1], ["a", "b"], [("a", "x y", [1, 2]), ("b", "z w", [3, 4])])
    assert tokenizer_agreement(corpus, lambda t: {"x y": [1, 2], "z w": [3, 5]}[t]) == {
        "sections": 2, "identical": 1, "first_difference": {"kind": "b", "index": 1, "ours": [4], "theirs": [5]}}
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as if not installed
    with pytest.raises(SystemExit, match="llama-cpp-python"):
        eval_fidelity.LlamaCppLogits(Path("model.gguf"), 32, 1)
