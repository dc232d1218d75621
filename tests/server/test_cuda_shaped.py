"""The CUDA path's choices, run on the CPU through the real server and the real openai SDK.

``DUALSERVE_CUDA_SHAPED=1`` (``decoders/engine/compile/cuda_shaped.py``) makes the server choose as it does
on CUDA: none of the project's kernels, ``torch.compile`` on the compile thread (not AOTInductor
packages), and eager attention through ``FlashPagedAttention`` over a PyTorch stand-in for
flash-attn's ``flash_attn_with_kvcache``. With bf16 weights, 256-token blocks and an EAGLE-3 head
(as the default model's bundled one), a default chat request routes to ``eagle`` while the graphs
compile, and once they are built ``eagle`` answers greedy requests with ``ar``'s tokens.

A tiny random Llama (three layers, the default model's trimmed vocabulary) keeps the compile short:
on a busy 2-core host the rows graph takes about 1.3 minutes, the chunks graph half a minute, and
the test about 3 minutes in all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import openai
import pytest

from server_fixture import free_port, log_tail, stop, wait_healthy
from tiny_eagle import write_tiny_eagle3
from tiny_gguf import trimmed

pytestmark = pytest.mark.slow

# Both step graphs of a served model (``CompiledStep.prewarm``): rows first, then chunks.
GRAPHS = ("the rows forward", "the chunks forward")
COMPILE_TIMEOUT_S = 900.0
VOCAB = 512  # the default model's first tokens (``tiny_gguf.trimmed``)
PROMPTS = [
    "Name three rivers in Europe.",
    "What is a prime number?",
    "Write a haiku about rain.",
    "Explain recursion to a child.",
    "List the planets in order.",
    "How does a bicycle stay upright?",
    "Translate 'good morning' into French.",
    "Why is the sky blue?",
]


@pytest.fixture(scope="module")
def tiny_bf16(default_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A three-layer random Llama in F32, with the default model's trimmed vocabulary and chat template."""
    from dualserve.clients import write_gguf as wg

    shape = wg.Shape("llama", 128, 3, 2, 1, 64, 256, 10000.0, 1e-5, 1024, True)
    out = tmp_path_factory.mktemp("cuda-shaped") / "tiny.gguf"
    return wg.write_gguf(out, shape, trimmed(wg.tokenizer_fields(default_gguf), VOCAB), matrix_type="F32",
                         embedding_type="F32", seed=3).path


@pytest.fixture(scope="module")
def tiny_head(tiny_bf16: Path) -> Path:
    """A random EAGLE-3 head for the tiny model: drafts from three of its layers' features, as the
    bundled head does for the default model."""
    head = tiny_bf16.parent / "head"
    write_tiny_eagle3(head, hidden_size=128, num_heads=2, num_kv_heads=1, head_dim=64, intermediate_size=256,
                      vocab_size=VOCAB, draft_vocab_size=64, target_hidden_size=128, seed=4)
    config = json.loads((head / "config.json").read_text())
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}  # each layer's input: 3 layers
    (head / "config.json").write_text(json.dumps(config))
    return head


@pytest.fixture(scope="module")
def served(tiny_bf16: Path, tiny_head: Path, cache_dir: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """(base URL, log) of a CUDA-shaped server: bf16, 256-token blocks, compiling in the background."""
    port, folder = free_port(), tmp_path_factory.mktemp("cuda-shaped-server")
    log = folder / "dualserve.log"
    (folder / "policy.json").write_text("{}")  # the routing defaults as written (server_fixture.py)
    cmd = [sys.executable, "-m", "dualserve.server.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--cache-dir", str(cache_dir), "--model", str(tiny_bf16), "--dtype", "bfloat16", "--quantization", "none",
           "--block-size", "256", "--eagle", str(tiny_head), "--twin", "none", "--threads", "1",
           "--router-policy", str(folder / "policy.json"), "--log-level", "info"]
    # A compile cache of its own: graphs of an earlier run would skip the compile thread's work.
    env = {**os.environ, "DUALSERVE_CUDA_SHAPED": "1", "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor")}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log)
        yield url, log
    finally:
        stop(proc)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=600, max_retries=0)


def wait_compiled(log: Path) -> None:
    deadline = time.monotonic() + COMPILE_TIMEOUT_S
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if "forward failed; staying eager" in text:
            pytest.fail(f"a step graph failed to compile:\n{log_tail(log)}")
        if all(f"compiled {g}" in text for g in GRAPHS):
            return
        time.sleep(1.0)
    pytest.fail(f"the step graphs were not compiled within {COMPILE_TIMEOUT_S:.0f} s:\n{log_tail(log)}")


def test_cuda_shaped_serving(served):
    url, log = served
    sdk = client(url)
    model = sdk.models.list().data[0].id
    assert "kernels unavailable: the cuda-shaped profile" in log.read_text(errors="replace"), log_tail(log)

    # A default chat request (temperature 1, no decoder named) while the compile thread works.
    raw = sdk.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=12)
    assert raw.headers["x-dualserve-decoder"] == "eagle"
    assert raw.parse().usage.completion_tokens > 0

    wait_compiled(log)  # "compiled": torch.compile's graphs, as on CUDA ("built" or "loaded": a package)
    assert not any(f"building {g}" in log.read_text(errors="replace") for g in GRAPHS)
    for prompt in PROMPTS:
        outs = {}
        for decoder in ("ar", "eagle"):
            raw = sdk.chat.completions.with_raw_response.create(
                model=model, messages=[{"role": "user", "content": prompt}], max_tokens=24, temperature=0,
                extra_body={"decoder": decoder})
            assert raw.headers["x-dualserve-decoder"] == decoder
            outs[decoder] = raw.parse().choices[0].message.content
        assert outs["eagle"] == outs["ar"], prompt
