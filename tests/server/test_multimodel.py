"""Several models in one server: an IDE's completion model and chat model served together.

A real ``dualserve serve`` subprocess on two tiny random GGUFs (told apart by their context
lengths, 256 and 384 tokens) and a broken one, with ``--max-loaded-models 1``: requests go by
their ``model`` field, a model loads on first use and the idle one unloads, ``/v1/models`` and
llama.cpp's ``/models`` report each model's state, ``/models/load`` and ``/models/unload`` work,
and an unknown model is a 404. A model gives the same greedy text served alone, beside another,
and after it was unloaded and loaded again. The command line's model list is checked without
loading anything.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from dualserve.decoders.engine.blocks import BlockPool, BlockTable
from dualserve.models import kernels
from dualserve.server import cli
from server_fixture import serving as served
from tiny_gguf import trimmed

QUANTIZATION = "w4a16" if kernels.available() else "int4"  # the suite's pinned formats (server_fixture.py)
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def tiny_models(default_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two tiny random Llama GGUFs with the default model's (trimmed) vocabulary and chat
    template, by served name, and a file that only looks like a GGUF."""
    from dualserve.clients import write_gguf as wg

    out, fields = tmp_path_factory.mktemp("models"), trimmed(wg.tokenizer_fields(default_gguf))
    models = {}
    for name, context, seed in (("chat", 256, 1), ("complete", 384, 2)):
        shape = wg.Shape("llama", 128, 2, 2, 1, 64, 256, 10000.0, 1e-5, context, True)
        models[name] = wg.write_gguf(out / f"{name}-tiny.gguf", shape, fields, matrix_type="Q4_0", seed=seed).path
    models["broken"] = out / "broken.gguf"
    models["broken"].write_bytes(b"GGUF but nothing a reader can use")
    return models


@contextlib.contextmanager
def serving(args: list[str], cache_dir: Path, log: Path) -> Iterator[str]:
    with served(["--cache-dir", str(cache_dir), "--no-compile", "--quantization", QUANTIZATION, "--threads", "1",
                 *args], log) as url:
        yield url


@pytest.fixture(scope="module")
def ide(tiny_models, cache_dir, tmp_path_factory) -> Iterator[tuple[str, Path]]:
    """(URL, log) of a server with chat (loaded at start) and complete (on first use), one in
    memory at a time, and a presets file adding the broken model."""
    folder = tmp_path_factory.mktemp("ide")
    presets = folder / "models.json"
    presets.write_text(json.dumps({"models": [{"name": "broken", "model": str(tiny_models["broken"])}]}))
    log = folder / "dualserve.log"
    args = ["--model", f"chat={tiny_models['chat']}", "--model", f"complete={tiny_models['complete']}",
            "--models-preset", str(presets), "--max-loaded-models", "1"]
    with serving(args, cache_dir, log) as url:
        yield url, log


def states(url: str) -> dict[str, dict]:
    return {m["id"]: m for m in httpx.get(f"{url}/v1/models").json()["data"]}


def status(url: str) -> dict[str, str]:
    return {name: card["status"]["value"] for name, card in states(url).items()}


def complete(client: openai.OpenAI, model: str) -> str:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text


def loads_of(log: Path, name: str) -> int:
    return log.read_text(errors="replace").count(f"loaded {name} on first use")


def test_an_ide_s_two_models_route_by_name_and_load_on_first_use(ide):
    url, log = ide
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
    assert status(url) == {"chat": "loaded", "complete": "unloaded", "broken": "unloaded"}
    assert states(url)["chat"]["max_model_len"] == 256 and states(url)["chat"]["decoders"] == ["ar"]

    first = client.completions.create(model="complete", prompt=PROMPT, max_tokens=12, temperature=0)
    assert first.model == "complete" and first.usage.completion_tokens == 12
    # Loaded on first use; with one model in memory at a time, the idle chat model made room.
    assert status(url) == {"chat": "unloaded", "complete": "loaded", "broken": "unloaded"}
    assert states(url)["complete"]["max_model_len"] == 384

    chat = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0)
    assert chat.model == "chat" and chat.usage.completion_tokens == 4
    assert status(url)["chat"] == "loaded" and status(url)["complete"] == "unloaded"
    # Loaded again into the same engine and block pool: the same greedy answer.
    assert complete(client, "complete") == first.choices[0].text


def test_concurrent_requests_for_a_model_share_one_load(ide):
    url, log = ide
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
    httpx.post(f"{url}/models/load", json={"model": "chat"}, timeout=120).raise_for_status()
    before = loads_of(log, "complete")
    texts: list[str] = []
    threads = [threading.Thread(target=lambda: texts.append(complete(client, "complete"))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(texts) == 3 and len(set(texts)) == 1
    assert loads_of(log, "complete") == before + 1


def test_models_load_and_unload_in_llama_cpp_s_shapes(ide):
    url, _ = ide
    listed = httpx.get(f"{url}/models").json()["data"]
    assert {m["id"] for m in listed} == {"chat", "complete", "broken"}
    assert all(m["status"]["value"] in ("loaded", "loading", "unloaded") and m["path"] for m in listed)

    loaded = httpx.post(f"{url}/models/load", json={"model": "complete"}, timeout=120)
    assert loaded.status_code == 200 and loaded.json() == {"success": True}
    assert status(url)["complete"] == "loaded"
    unloaded = httpx.post(f"{url}/models/unload", json={"model": "complete"}, timeout=60)
    assert unloaded.status_code == 200 and unloaded.json() == {"success": True}
    assert httpx.get(f"{url}/v1/models/complete").json()["status"] == {"value": "unloaded"}

    again = httpx.post(f"{url}/models/unload", json={"model": "complete"}, timeout=60)
    assert again.status_code == 400 and again.json()["error"]["code"] == "model_not_loaded"
    for path in ("/models/load", "/models/unload"):
        missing = httpx.post(f"{url}{path}", json={"model": "nope"}, timeout=60)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert httpx.post(f"{url}/models/load", content=b"{}", timeout=60).status_code == 400
    assert httpx.get(f"{url}/v1/models/nope").status_code == 404


def test_an_unknown_model_is_a_404_in_openai_s_shape(ide):
    url, _ = ide
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60, max_retries=0)
    with pytest.raises(openai.NotFoundError) as seen:
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    assert seen.value.body["code"] == "model_not_found" and "chat, complete, broken" in seen.value.body["message"]


def test_a_model_that_cannot_load_fails_its_requests_and_the_server_serves_on(ide):
    url, _ = ide
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
    failed = httpx.post(f"{url}/v1/completions", json={"model": "broken", "prompt": "hi", "max_tokens": 2},
                        timeout=120)
    assert failed.status_code == 503
    error = failed.json()["error"]
    assert error["code"] == "model_load_failed" and "broken" in error["message"] and error["type"] == "server_error"
    card = states(url)["broken"]
    assert card["status"]["value"] == "unloaded" and card["status"]["failed"] is True
    assert httpx.get(f"{url}/health").status_code == 200
    assert client.completions.create(model="chat", prompt="hi", max_tokens=2).usage.completion_tokens == 2


def test_a_model_gives_the_same_text_served_alone(ide, tiny_models, cache_dir, tmp_path):
    url, _ = ide
    beside = complete(openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0), "complete")
    with serving(["--model", str(tiny_models["complete"])], cache_dir, tmp_path / "alone.log") as alone:
        client = openai.OpenAI(base_url=f"{alone}/v1", api_key="unused", timeout=120, max_retries=0)
        assert complete(client, "complete-tiny") == beside
        # One model served: no state to wait on, and the old leniency for "default" stays.
        assert status(alone) == {"complete-tiny": "loaded"}
        assert complete(client, "default") == beside


# ---- the command line: which models, by which names (nothing loads) ----------------------------


class Loaded(Exception):
    """Raised by the stand-in loader: the test only wants the settings it was given."""


@pytest.fixture
def serve_settings(monkeypatch):
    def capture(settings, *_, **__):
        raise Loaded(settings)

    monkeypatch.setattr(cli, "load_deployment", capture)
    monkeypatch.setattr("dualserve.server.lifecycle.bind_port", lambda host, port: None)

    def run(*argv: str):
        with pytest.raises(Loaded) as seen:
            cli.main(["serve", "--no-compile", *argv])
        return seen.value.args[0]
    return run


def test_models_from_flags_a_folder_and_a_toml_presets_file(serve_settings, tiny_models, tmp_path):
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "coder.gguf").write_bytes(tiny_models["complete"].read_bytes())
    (folder / "notes.txt").write_text("not a model")
    presets = tmp_path / "models.toml"
    presets.write_text(f'[[models]]\nname = "chatty"\nmodel = "{tiny_models["chat"]}"\nquantization = "int8"\n'
                       "preload = true\n")
    settings = serve_settings("--model", str(tiny_models["chat"]), "--models-dir", str(folder), "--models-preset",
                              str(presets), "--max-loaded-models", "2", "--models-memory", "1.5", "--quantization",
                              "int4", "--twin", "none")
    catalog = settings.catalog
    assert catalog.names == ["chat-tiny", "chatty", "coder"]
    assert [s.quantization for s in catalog.specs] == ["int4", "int8", "int4"]
    assert catalog.specs[0].twin == "none" and catalog.specs[2].twin == "auto"  # model flags: the first --model's
    assert catalog.preload == ("chatty",) and (catalog.max_loaded, catalog.memory_gb) == (2, 1.5)
    assert settings.model == catalog.spec("chatty")  # the first preloaded one builds the engine
    # The pool is sized once for the two largest models that may be loaded together.
    assert settings.pool.bytes_per_block == 2 * cli.block_bytes(catalog.specs[0], settings.pool.block_size)


def test_one_model_is_served_as_before(serve_settings):
    settings = serve_settings()
    assert settings.catalog.names == ["SmolLM2-135M-Instruct"] and settings.pool.bytes_per_block is None


def test_two_models_with_one_name_are_a_one_line_error():
    run = subprocess.run([sys.executable, "-m", "dualserve.server.cli", "serve", "--no-compile", "--model",
                          "a=x.gguf", "--model", "a=y.gguf"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr == "dualserve: two models are served as 'a': name each one, e.g. --model NAME=PATH\n"


@pytest.mark.parametrize("argv, says", [
    (["--model", "a=x.gguf", "--preload", "b"], "--preload 'b': no such model"),
    (["--models-dir", "/nonexistent-models"], "not a directory"),
    (["--model", "x.gguf", "--model", "y.gguf", "--tensor-parallel-size", "2"], "on one rank only"),
])
def test_a_bad_model_list_is_a_one_line_error(argv, says, capsys):
    assert cli.main(["serve", "--no-compile", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err and err.startswith("dualserve: ")


def test_a_bad_presets_file_is_a_one_line_error(tmp_path, capsys):
    presets = tmp_path / "models.json"
    for text, says in (("[{\"name\": \"a\"}]", "needs a 'name' and a 'model'"),
                       ("[{\"name\": \"a\", \"model\": \"x\", \"ctx\": 4}]", "sets 'ctx'"), ("{", "models.json")):
        presets.write_text(text)
        assert cli.main(["serve", "--models-preset", str(presets)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err


# ---- the block pool: a model's prefix-cache entries leave with it ------------------------------


def test_dropping_a_namespace_frees_its_cached_blocks_and_keeps_the_others():
    pool = BlockPool(8, 4)
    tokens = list(range(9))
    tables = {}
    for namespace in ("a", "b"):
        table = tables[namespace] = BlockTable(namespace=namespace)
        pool.allocate(table, tokens, len(tokens))
        pool.mark_written(table, tokens, len(tokens))
        pool.free(table)
    assert pool.match_prefix(tokens, "a")[1] == 8 and pool.match_prefix(tokens, "b")[1] == 8
    assert pool.drop_namespaces(["a"]) == 2
    assert pool.match_prefix(tokens, "a")[1] == 0 and pool.match_prefix(tokens, "b")[1] == 8
    assert pool.num_free_blocks == 8
    pool.check()
