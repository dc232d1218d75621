"""The served check of ``.ci/gpu``: a random model through the real server, one weight format per run.

It writes a random Llama GGUF (``clients/write_gguf``; the default model's tokenizer from
``.ci/wheels/tokenizer.gguf`` where ``.ci/gpu-wheels`` put one, else from the model cache) and a
random diffusion twin beside it, starts ``dualserve serve`` on it in ``--dtype bfloat16`` with the
format asked for (``none`` or ``int4``), checks that ``eagle`` answers greedy requests with ``ar``'s
tokens, and times streamed decoding with one stream and with 16 for ``ar``, ``eagle`` and
``diffusion`` (128 tokens each, greedy, ``ignore_eos``). Results go to one JSON file, written after
every group, so a run cut off by its deadline keeps what it measured.

On CUDA the model has SmolLM2-135M's shape, so the bundled EAGLE head (``models/assets``) drafts
for it, and the server compiles its steps in the background (the check waits for them up to
``--wait-compile`` seconds; whatever is not ready then runs eagerly). With ``--tiny`` (the CPU
rehearsal) the model is a two-layer toy, eager, EAGLE drafts come from suffixes, and fewer tokens
are decoded. The exit status is 1 if a greedy pair differs or a request fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from dualserve.clients import write_gguf as wg

ROOT = Path(__file__).resolve().parent.parent
HEAD = ROOT / "models" / "assets" / "eagle-smollm2"
# SmolLM2-135M's config.json: the bundled EAGLE head's geometry.
SMOLLM2 = wg.Shape("llama", 576, 30, 9, 3, 64, 1536, 100000.0, 1e-5, 8192, True)
TOY = wg.Shape("llama", 64, 2, 2, 1, 32, 128, 10000.0, 1e-5, 2048, True)
COMPILED = re.compile(r"(built|loaded|compiled) the (\w+) forward in ([\d.]+) s")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,",
           "The quick brown fox", "import numpy as np\n", "Dear team,", "In 1969, the first"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--quantization", default="none", choices=["none", "int4"])
    p.add_argument("--work", type=Path, required=True, help="where the server's log goes")
    p.add_argument("--models", type=Path, default=Path("/tmp/gpu-serve-models"),
                   help="where the random model and the server's model cache go (not under $OUT: too large to return)")
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--deadline", type=float, default=150.0, help="seconds for the whole run")
    p.add_argument("--wait-compile", type=float, default=60.0)
    p.add_argument("--tiny", action="store_true", help="the CPU rehearsal's toy model, eager")
    p.add_argument("--port", type=int, default=8391)
    return p.parse_args()


def write_model(work: Path, tiny: bool) -> tuple[Path, Path]:
    """(GGUF, twin directory) of a random model, written once per work folder."""
    gguf, twin = work / "model.gguf", work / "twin"
    if not (twin / "config.json").exists():
        work.mkdir(parents=True, exist_ok=True)
        source = ROOT / ".ci" / "wheels" / "tokenizer.gguf"
        if not source.exists():
            from dualserve.models.hub import default_cache_dir, resolve_model
            _, source = resolve_model(None, default_cache_dir())
        wg.write_gguf(gguf, TOY if tiny else SMOLLM2, wg.tokenizer_fields(source), matrix_type="F16",
                      embedding_type="F16", seed=0)
        wg.write_random_twin(gguf, twin)
    return gguf, twin


def server_command(a: argparse.Namespace, gguf: Path, twin: Path) -> list[str]:
    cmd = [sys.executable, "-m", "dualserve.server.cli", "serve", "--model", str(gguf), "--twin", str(twin),
           "--eagle", "suffix" if a.tiny else str(HEAD), "--device", a.device, "--dtype", "bfloat16",
           "--quantization", a.quantization, "--cache-dir", str(a.models / "cache"), "--port", str(a.port),
           "--block-size", "256", "--max-num-seqs", "16", "--shutdown-timeout", "5", "--log-level", "info"]
    return cmd + (["--no-compile"] if a.tiny else [])


async def one(c: httpx.AsyncClient, model: str, decoder: str, prompt: str, tokens: int, greedy_text: bool = False):
    """One streamed completion: its tokens, time to first token, decode rate and text."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "decoder": decoder,
            **({} if greedy_text else {"ignore_eos": True})}
    t0, first, text, usage = time.perf_counter(), None, [], {}
    async with c.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line[6:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": json.dumps(chunk["error"])[:300]}
            for choice in chunk.get("choices") or []:
                first = first or time.perf_counter()
                text.append(choice.get("text") or "")
            usage = chunk.get("usage") or usage
    end, n = time.perf_counter(), usage.get("completion_tokens") or 0
    rate = (n - 1) / (end - first) if n > 1 and first and end > first else None
    return {"tokens": n, "ttft_s": first and round(first - t0, 4), "decode_tok_s": rate and round(rate, 2),
            "text": "".join(text)}


async def group(c, model: str, decoder: str, streams: int, tokens: int) -> dict:
    t0 = time.perf_counter()
    recs = await asyncio.gather(*[one(c, model, decoder, PROMPTS[i % len(PROMPTS)], tokens) for i in range(streams)])
    wall = time.perf_counter() - t0
    ok = [r for r in recs if "error" not in r and r["tokens"]]
    rates = [r["decode_tok_s"] for r in ok if r["decode_tok_s"]]
    return {"decoder": decoder, "streams": streams, "ok": len(ok), "wall_s": round(wall, 3),
            "errors": sorted({r["error"] for r in recs if "error" in r})[:3],
            "median_decode_tok_s": rates and statistics.median(rates),
            "aggregate_tok_s": round(sum(r["tokens"] for r in ok) / wall, 1)}


async def check(a: argparse.Namespace, url: str, log: Path, result: dict) -> bool:
    save = lambda: a.json.write_text(json.dumps(result, indent=1))  # noqa: E731
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120.0, connect=2.0)) as c:
        model = (await c.get("/v1/models")).json()["data"][0]["id"]
        t0 = time.perf_counter()
        while not a.tiny and time.perf_counter() - t0 < a.wait_compile and len(COMPILED.findall(log.read_text())) < 2:
            await asyncio.sleep(1.0)
        result["compiled_at_start"] = COMPILED.findall(log.read_text())
        pairs = []
        for prompt in PROMPTS:  # greedy, one at a time: eagle must give ar's tokens
            ar = await one(c, model, "ar", prompt, 16 if a.tiny else 32, greedy_text=True)
            eagle = await one(c, model, "eagle", prompt, 16 if a.tiny else 32, greedy_text=True)
            pairs.append({"prompt": prompt, "ar": ar.get("text", ar.get("error")),
                          "eagle": eagle.get("text", eagle.get("error"))})
        result["greedy_pairs"], result["eagle_equals_ar"] = pairs, all(p["ar"] == p["eagle"] for p in pairs)
        save()
        tokens = 32 if a.tiny else 128
        result["groups"] = []
        for decoder in ("ar", "eagle", "diffusion"):
            for streams in (1, 16):
                if time.perf_counter() - START > a.deadline - 20:
                    result["groups"].append({"decoder": decoder, "streams": streams, "skipped": "deadline"})
                    continue
                result["groups"].append(await group(c, model, decoder, streams, tokens))
                save()
        result["compiled_at_end"] = COMPILED.findall(log.read_text())
        save()
        return result["eagle_equals_ar"] and all(not g.get("errors") for g in result["groups"])


def wait_healthy(url: str, proc: subprocess.Popen, deadline: float) -> None:
    while time.perf_counter() - START < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} during start-up")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not answer /health in time")


def main() -> int:
    a = parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    gguf, twin = write_model(a.models / ("toy" if a.tiny else "smollm2"), a.tiny)
    log = a.work / "server.log"
    result: dict = {"device": a.device, "quantization": a.quantization, "dtype": "bfloat16", "block_size": 256}
    url = f"http://127.0.0.1:{a.port}"
    with open(log, "wb") as out:
        proc = subprocess.Popen(server_command(a, gguf, twin), stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, proc, a.deadline / 2)
        result["ready_s"] = round(time.perf_counter() - START, 1)
        ok = asyncio.run(check(a, url, log, result))
    except Exception as e:  # noqa: BLE001 - recorded in the JSON, then the status says it failed
        result["error"], ok = f"{type(e).__name__}: {e}"[:500], False
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        result["tracebacks"] = log.read_text(errors="replace").count("Traceback (most recent")
        a.json.write_text(json.dumps(result, indent=1))
    for g in result.get("groups", []):
        print(f"{g['decoder']:<9} x{g['streams']:<3} " + (g.get("skipped") or
              f"ok {g['ok']}, median {g['median_decode_tok_s']} tok/s a stream, {g['aggregate_tok_s']} tok/s in all"))
    print("eagle == ar greedy:", result.get("eagle_equals_ar"), "| error:", result.get("error"))
    return 0 if ok else 1


START = time.perf_counter()
if __name__ == "__main__":
    sys.exit(main())
