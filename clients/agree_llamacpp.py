"""Do dualserve and llama.cpp give the same greedy tokens on the same GGUF file?

Run as::

    python -m dualserve.clients.agree_llamacpp --gguf FILE [--dualserve-args "--quantization w4a16"]

Starts ``dualserve serve`` on the file (or uses ``--dualserve-url``) and loads the same file in
llama.cpp in-process (llama-cpp-python, the project's side-by-side reference; not a dependency).
Each prompt (``--prompt``, repeatable; default five short ones in prose and code; pass a chat
template's rendered text to compare chat turns) is answered greedily by both: dualserve through
the OpenAI SDK (``/v1/completions``), llama.cpp by ``generate`` from the ids its own tokenizer
gives (with BOS where the file asks), both for ``--max-tokens`` tokens or to an end-of-generation
token; the texts are compared. Prints, per prompt, whether the texts are identical and otherwise
after how many tokens they part, and exits 1 if any differ. Where they differ, ``clients/eval_fidelity
--llama-cpp`` says which of the two is closer to the float reference.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from .bench_servers import dualserve_command, free_port, start_server, wait_ready

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "SELECT name, email FROM users WHERE"]


def llama_tokens(llm, prompt_ids: list[int], max_tokens: int, stops: set[int]) -> list[int]:
    out: list[int] = []
    for token in llm.generate(prompt_ids, temp=0.0, top_k=1, reset=True):
        if token in stops:
            break
        out.append(token)
        if len(out) >= max_tokens:
            break
    return out


def end_of_generation(llm) -> set[int]:
    """The ids llama.cpp stops at (its vocabulary's end-of-generation set)."""
    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    return {i for i in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)}


def ours_text(client, model: str, prompt: str, max_tokens: int) -> str:
    reply = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
    return reply.choices[0].text


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", type=Path, required=True)
    p.add_argument("--prompt", action="append", help="a prompt (repeatable; default: five short ones)")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dualserve-url", help="a running dualserve server on the same file")
    p.add_argument("--dualserve-args", default="", help="extra arguments for dualserve serve")
    p.add_argument("--startup-timeout", type=float, default=900)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import llama_cpp
    except ImportError:
        raise SystemExit("llama-cpp-python is not installed; see clients/bench_llamacpp.py for how to build it")
    import openai

    llm = llama_cpp.Llama(str(args.gguf), n_ctx=1024, n_threads=args.threads, verbose=False)
    stops = end_of_generation(llm)
    with contextlib.ExitStack() as stack:
        url = args.dualserve_url
        if not url:
            port = free_port()
            extra = ["--model", str(args.gguf), *shlex.split(args.dualserve_args)]
            server = start_server("dualserve", dualserve_command(args.threads, port, extra), port,
                                  Path(tempfile.mkdtemp(prefix="agree_llamacpp_")))
            stack.callback(server.stop)
            print(f"starting dualserve (log {server.log_path})", file=sys.stderr, flush=True)
            wait_ready(server, args.startup_timeout)
            url = server.url
        client = openai.OpenAI(base_url=url, api_key="none")
        model = client.models.list().data[0].id
        prompts = args.prompt or PROMPTS
        same = 0
        for prompt in prompts:
            want = llama_tokens(llm, llm.tokenize(prompt.encode(), add_bos=True, special=True), args.max_tokens, stops)
            text = llm.detokenize(want).decode(errors="replace")
            ours = ours_text(client, model, prompt, args.max_tokens)
            ok = ours == text
            same += ok
            common = next((i for i, (a, b) in enumerate(zip(ours, text)) if a != b), min(len(ours), len(text)))
            first = len(llm.tokenize(text[:common].encode(), add_bos=False, special=True))
            print(f"{prompt[:36]!r:40} " + ("identical" if ok else f"part after {first} of {len(want)} tokens")
                  + f": {text!r}" + ("" if ok else f" | ours: {ours!r}"), flush=True)
        print(f"{same}/{len(prompts)} identical greedy continuations (at most {args.max_tokens} tokens)")
        return 0 if same == len(prompts) else 1


if __name__ == "__main__":
    from dualserve.models.errors import one_line

    raise SystemExit(one_line(main))
