"""``POST /v1/embeddings`` end to end: tiny Qwen3 checkpoints against transformers, and real clients.

A tiny Qwen3-Embedding (last-token pooling declared by its sentence-transformers files) is served
by ``dualserve serve`` in a subprocess; its vectors must match transformers' last hidden state at
the last token, normalised, within 1e-4, through the openai SDK (float and base64), LangChain and
LlamaIndex. A plain tiny Qwen3 chat model and a tiny reranker are served in process from one
deployment: the chat model embeds by mean pooling, the reranker cannot embed, and an embedding
leaves the prefix cache as it was.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import openai
import pytest
import torch

from dualserve.models.pooling import PoolingProfile, read_profile
from tiny_embedding import (encode, reference_hidden, serve, serve_in_process, write_tiny_qwen3,
                            write_tiny_qwen3_embedding, write_tiny_qwen3_reranker)

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = ["the cat sat on the mat", "paris is the capital of france", "what is the red planet"]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def embedder(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    """(base URL, checkpoint) of a subprocess server on the tiny Qwen3-Embedding."""
    root = tmp_path_factory.mktemp("embedding")
    checkpoint = write_tiny_qwen3_embedding(root / "tiny-qwen3-embedding")
    with serve(checkpoint, root) as url:
        yield url, checkpoint


@pytest.fixture(scope="module")
def in_process(tmp_path_factory) -> Iterator[tuple[str, object, Path]]:
    """(base URL, deployment, chat checkpoint) of a chat model and a reranker served in process."""
    root = tmp_path_factory.mktemp("pooling")
    chat = write_tiny_qwen3(root / "tiny-qwen3-chat")
    reranker = write_tiny_qwen3_reranker(root / "tiny-qwen3-reranker")
    with serve_in_process([chat, reranker]) as (url, dep):
        yield url, dep, chat


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def last_token_reference(checkpoint: Path, text: str) -> torch.Tensor:
    hidden = reference_hidden(checkpoint, encode(checkpoint, text))[-1]
    return hidden / hidden.norm()


def assert_close(got, want: torch.Tensor) -> None:
    got = torch.tensor(got, dtype=torch.float32)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < TOLERANCE


def test_last_token_embeddings_match_transformers_through_the_sdk(embedder) -> None:
    url, checkpoint = embedder
    client = client_of(url)
    for fmt in ({"encoding_format": "float"}, {}):  # untold, the SDK asks for base64 and decodes it
        reply = client.embeddings.create(model=checkpoint.name, input=TEXTS, **fmt)
        assert reply.object == "list" and reply.model == checkpoint.name
        assert [d.index for d in reply.data] == [0, 1, 2] and all(d.object == "embedding" for d in reply.data)
        for d, text in zip(reply.data, TEXTS):
            assert_close(d.embedding, last_token_reference(checkpoint, text))
        tokens = sum(len(encode(checkpoint, t)) for t in TEXTS)  # <|endoftext|> appended, as transformers does
        assert reply.usage.prompt_tokens == reply.usage.total_tokens == tokens


def test_base64_is_little_endian_float32(embedder) -> None:
    url, checkpoint = embedder
    body = {"model": checkpoint.name, "input": TEXTS[0]}
    floats = httpx.post(f"{url}/v1/embeddings", json=body, timeout=60).json()["data"][0]["embedding"]
    raw = httpx.post(f"{url}/v1/embeddings", json={**body, "encoding_format": "base64"}, timeout=60).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.array_equal(decoded, np.array(floats, dtype=np.float32))


def test_token_ids_and_batches_give_the_text_vectors(embedder) -> None:
    url, checkpoint = embedder
    client = client_of(url)
    ids = [encode(checkpoint, t) for t in TEXTS]
    by_text = [d.embedding for d in client.embeddings.create(model=checkpoint.name, input=TEXTS,
                                                             encoding_format="float").data]
    by_ids = [d.embedding for d in client.embeddings.create(model=checkpoint.name, input=ids,
                                                            encoding_format="float").data]
    one = client.embeddings.create(model=checkpoint.name, input=ids[1], encoding_format="float").data
    np.testing.assert_allclose(by_ids, by_text, atol=1e-6)
    np.testing.assert_allclose(one[0].embedding, by_text[1], atol=1e-6)


def test_more_inputs_than_one_wave(embedder) -> None:
    url, checkpoint = embedder
    inputs = [TEXTS[i % 3] for i in range(150)]  # LangChain sends up to 1000 a request
    data = client_of(url).embeddings.create(model=checkpoint.name, input=inputs, encoding_format="float").data
    assert [d.index for d in data] == list(range(150))
    for d in data:
        assert_close(d.embedding, torch.tensor(data[d.index % 3].embedding))


def test_dimensions_cut_and_renormalise(embedder) -> None:
    url, checkpoint = embedder
    reply = client_of(url).embeddings.create(model=checkpoint.name, input=TEXTS[0], dimensions=16,
                                             encoding_format="float")
    full = reference_hidden(checkpoint, encode(checkpoint, TEXTS[0]))[-1]
    assert_close(reply.data[0].embedding, full[:16] / full[:16].norm())
    for bad in (0, 33):
        r = httpx.post(f"{url}/v1/embeddings", json={"input": "a", "dimensions": bad}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"


def test_langchain_and_llamaindex_clients(embedder) -> None:
    from langchain_openai import OpenAIEmbeddings
    from llama_index.embeddings.openai_like import OpenAILikeEmbedding

    url, checkpoint = embedder
    want = [last_token_reference(checkpoint, t) for t in TEXTS]
    lc = OpenAIEmbeddings(model=checkpoint.name, base_url=f"{url}/v1", api_key="unused",
                          check_embedding_ctx_length=False)
    for got, ref in zip(lc.embed_documents(TEXTS), want):
        assert_close(got, ref)
    assert_close(lc.embed_query(TEXTS[0]), want[0])
    li = OpenAILikeEmbedding(model_name=checkpoint.name, api_base=f"{url}/v1", api_key="unused")
    assert_close(li.get_text_embedding(TEXTS[1]), want[1])
    for got, ref in zip(li.get_text_embedding_batch(TEXTS), want):
        assert_close(got, ref)


@pytest.mark.parametrize("body", [
    {}, {"input": []}, {"input": ""}, {"input": ["a", ""]}, {"input": [[]]}, {"input": [1.5]},
    {"input": {"text": "a"}}, {"input": ["a", 1]}, {"input": [[1, 2], "a"]}, {"input": [10_000]},
    {"input": "a", "encoding_format": "hex"}, {"input": "a", "dimensions": "8"},
    {"input": " ".join(["cat"] * 600)}, {"input": [[3] * 600]},
])
def test_bad_input_is_a_400_in_openai_shape(embedder, body) -> None:
    url, _ = embedder
    r = httpx.post(f"{url}/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]


def test_an_unknown_model_is_a_404(embedder) -> None:
    url, _ = embedder
    r = httpx.post(f"{url}/v1/embeddings", json={"model": "nope", "input": "a"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_a_chat_model_embeds_by_mean_pooling(in_process) -> None:
    url, _, chat = in_process
    reply = client_of(url).embeddings.create(model=chat.name, input=TEXTS, encoding_format="float")
    for d, text in zip(reply.data, TEXTS):
        mean = reference_hidden(chat, encode(chat, text)).mean(0)
        assert_close(d.embedding, mean / mean.norm())
    models = {m.id: m for m in client_of(url).models.list().data}
    assert models[chat.name].decoders == ["ar"]  # pooling decoders are never offered for generation


def test_a_reranker_cannot_embed(in_process) -> None:
    url, _, _ = in_process
    r = httpx.post(f"{url}/v1/embeddings", json={"model": "tiny-qwen3-reranker", "input": "a"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    assert "/v1/rerank" in r.json()["error"]["message"]


def test_embedding_leaves_the_prefix_cache_untouched(in_process) -> None:
    url, dep, chat = in_process
    pool = dep.engine.pool
    text = " ".join(["the cat sat on the mat and the dog sat on the red planet"] * 4)  # several blocks
    published, hits = dict(pool._cached), pool.stats.hits
    client = client_of(url)
    client.embeddings.create(model=chat.name, input=[text, text], encoding_format="float")
    assert dict(pool._cached) == published and pool.stats.hits == hits
    assert pool.num_used_blocks == 0  # its blocks were freed with it

    def cached() -> int:
        r = httpx.post(f"{url}/v1/completions", json={"model": chat.name, "prompt": text, "max_tokens": 1,
                                                      "temperature": 0}, timeout=60).json()
        return r["usage"]["dualserve"]["cached_prompt_tokens"]

    assert cached() == 0  # nothing the embedding computed was published
    assert cached() > 0   # while generation's own blocks are


# ---- what a checkpoint declares (no server) ----------------------------------------------------


def write_gguf_header(path: Path, pooling_type: int | None) -> Path:
    """A GGUF with metadata only: what ``read_profile`` reads of one."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "qwen3")
    if pooling_type is not None:
        writer.add_pooling_type(gguf.PoolingType(pooling_type))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("pooling_type, want", [
    (None, PoolingProfile()), (1, PoolingProfile("embedding", "mean", None)),
    (2, PoolingProfile("embedding", "cls", None)), (3, PoolingProfile("embedding", "last", None)),
    (4, PoolingProfile("rerank", "last", ())),
])
def test_a_gguf_declares_its_pooling(tmp_path, pooling_type, want) -> None:
    assert read_profile(write_gguf_header(tmp_path / "m.gguf", pooling_type)) == want


def test_a_directory_declares_pooling_sizes_and_rerank(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "matryoshka_dimensions": [8, 16]}))
    assert read_profile(tmp_path) == PoolingProfile()  # no sentence-transformers files: a generation model
    assert read_profile(tmp_path, "last") == PoolingProfile("generation", "last", ())  # --pooling
    (tmp_path / "modules.json").write_text(json.dumps([{"idx": 1, "name": "1", "path": "1_Pooling",
                                                        "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    assert read_profile(tmp_path) == PoolingProfile("embedding", "cls", (8, 16))
    (tmp_path / "README.md").write_text("---\nlicense: apache-2.0\n---\n# Qwen3-Reranker-4B\n")
    assert read_profile(tmp_path).purpose == "rerank"


def test_metrics_count_embeddings_under_their_decoder(embedder) -> None:
    url, checkpoint = embedder
    client_of(url).embeddings.create(model=checkpoint.name, input=TEXTS[0], encoding_format="float")
    metrics = httpx.get(f"{url}/metrics", timeout=60)
    assert metrics.status_code == 200 and 'decoder="embed"' in metrics.text
