"""``POST /v1/rerank`` end to end: Qwen3-Reranker's yes/no score against transformers, and the fallback.

A tiny Qwen3-Reranker (known by its README, as llama.cpp knows it), a tiny Qwen3 chat model and a
tiny Qwen3-Embedding are served in process from one deployment. The reranker's scores must be
transformers' P(yes) over its model card's prompt within 1e-4; the chat model's the same over its
chat template; the embedding model cannot rerank. On the default model (a real subprocess server)
the chat-template fallback answers the shapes llama.cpp, Jina and Cohere clients send.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import pytest
import torch

from dualserve.models.pooling import JUDGE_SYSTEM, RERANKER_PREFIX, RERANKER_SUFFIX, rerank_user_turn
from tiny_embedding import (encode, reference_logits, serve_in_process, write_tiny_qwen3, write_tiny_qwen3_embedding,
                            write_tiny_qwen3_reranker)

pytestmark = pytest.mark.usefixtures("one_thread")

QUERY = "what is the capital of france"
DOCS = ["paris is the capital of france", "the cat sat on the mat", "mars is the red planet"]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[str, dict[str, Path]]]:
    root = tmp_path_factory.mktemp("rerank")
    paths = {"reranker": write_tiny_qwen3_reranker(root / "tiny-qwen3-reranker"),
             "chat": write_tiny_qwen3(root / "tiny-qwen3-chat"),
             "embedding": write_tiny_qwen3_embedding(root / "tiny-qwen3-embedding")}
    with serve_in_process(list(paths.values())) as (url, _):
        yield url, paths


def p_yes(checkpoint: Path, ids: list[int]) -> float:
    """transformers' P(yes) at the last position: a softmax over the "yes" and "no" logits."""
    logits = reference_logits(checkpoint, ids)
    yes, no = encode(checkpoint, "yes", False)[0], encode(checkpoint, "no", False)[0]
    return torch.softmax(torch.stack([logits[yes], logits[no]]), 0)[0].item()


def reranker_reference(checkpoint: Path, doc: str) -> float:
    """Qwen3-Reranker's model card: prefix + tokenizer(pair) + suffix, each tokenized apart."""
    parts = (RERANKER_PREFIX, rerank_user_turn(QUERY, doc), RERANKER_SUFFIX)
    return p_yes(checkpoint, [t for part in parts for t in encode(checkpoint, part, False)])


def chat_reference(checkpoint: Path, doc: str) -> float:
    """The same turns through the tiny model's ChatML template, written out."""
    text = (f"<|im_start|>system\n{JUDGE_SYSTEM}<|im_end|>\n<|im_start|>user\n{rerank_user_turn(QUERY, doc)}"
            "<|im_end|>\n<|im_start|>assistant\n")
    return p_yes(checkpoint, encode(checkpoint, text, False))


def rerank(url: str, path: str = "/v1/rerank", **body) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)


@pytest.mark.parametrize("kind, reference", [("reranker", reranker_reference), ("chat", chat_reference)])
def test_scores_match_transformers(served, kind, reference) -> None:
    url, paths = served
    reply = rerank(url, model=paths[kind].name, query=QUERY, documents=DOCS)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "list" and body["model"] == paths[kind].name and body["id"]
    want = [reference(paths[kind], doc) for doc in DOCS]
    results = body["results"]
    assert sorted(r["index"] for r in results) == [0, 1, 2] and all("document" not in r for r in results)
    for r in results:
        assert abs(r["relevance_score"] - want[r["index"]]) < TOLERANCE
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0


def test_top_n_documents_and_aliases(served) -> None:
    url, paths = served
    model = paths["reranker"].name
    full = rerank(url, model=model, query=QUERY, documents=DOCS).json()["results"]
    for path in ("/rerank", "/v1/reranking"):
        top = rerank(url, path, model=model, query=QUERY, documents=[{"text": d} for d in DOCS], top_n=2,
                     return_documents=True).json()["results"]
        assert [r["index"] for r in top] == [r["index"] for r in full[:2]]
        assert [r["document"]["text"] for r in top] == [DOCS[r["index"]] for r in top]
    assert len(rerank(url, model=model, query=QUERY, documents=DOCS, top_n=10).json()["results"]) == 3


def test_an_embedding_model_cannot_rerank(served) -> None:
    url, paths = served
    reply = rerank(url, model=paths["embedding"].name, query=QUERY, documents=DOCS)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "model"


@pytest.mark.parametrize("body", [
    {"documents": DOCS}, {"query": "", "documents": DOCS}, {"query": QUERY}, {"query": QUERY, "documents": []},
    {"query": QUERY, "documents": "paris"}, {"query": QUERY, "documents": [1, 2]},
    {"query": QUERY, "documents": [{"title": "x"}]}, {"query": QUERY, "documents": DOCS, "top_n": 0},
    {"query": 3, "documents": DOCS}, {"query": QUERY, "documents": [" ".join(["cat"] * 600)]},
])
def test_bad_input_is_a_400(served, body) -> None:
    url, paths = served
    reply = rerank(url, model=paths["reranker"].name, **body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["type"] == "invalid_request_error"


def test_the_default_model_reranks_through_its_chat_template(server_url) -> None:
    docs = ["Paris is the capital and largest city of France.", "Bananas are rich in potassium.",
            "The Eiffel Tower is in Paris."]
    llama = rerank(server_url, "/rerank", query="What is the capital of France?", documents=docs, top_n=3)
    assert llama.status_code == 200, llama.text
    results = llama.json()["results"]
    assert sorted(r["index"] for r in results) == [0, 1, 2]
    assert all(0.0 <= r["relevance_score"] <= 1.0 for r in results)
    assert [r["relevance_score"] for r in results] == sorted((r["relevance_score"] for r in results), reverse=True)
    # Cohere's and Jina's body: {text} documents, return_documents; the same scores at temperature-free scoring.
    cohere = rerank(server_url, model="SmolLM2-135M-Instruct", query="What is the capital of France?",
                    documents=[{"text": d} for d in docs], top_n=1, return_documents=True).json()["results"]
    assert cohere[0]["index"] == results[0]["index"] and cohere[0]["document"]["text"] == docs[results[0]["index"]]
    assert abs(cohere[0]["relevance_score"] - results[0]["relevance_score"]) < 1e-5
