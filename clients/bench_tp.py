"""Tensor parallelism: throughput of N ranks against one, on the same model, with the outputs compared.

Runs in one process (rank 0, spawning the others as ``dualserve serve --tensor-parallel-size N``
does), without HTTP: for each decoder, ``--batch`` greedy requests of ``--max-tokens`` tokens are
submitted together and run to completion, first on a one-rank deployment, then on N ranks. Reports
generated tokens per second for both and whether every request's tokens were identical.

On a CPU host the ranks share its cores, so N ranks are not expected to be faster than one: the
collectives (two all-gathers per block half with ``--tp-reduction exact``, one all-reduce with
``sum``) are added latency with no extra compute to spread. The point of the CPU run is the cost of
the step protocol, and that output does not change.

    python -m dualserve.clients.bench_tp --tp 2 --decoders ar eagle diffusion --max-tokens 32

``--group`` with ``--tp 1`` runs the one-rank side through a process group of one (on CUDA: the
NCCL path, checked against the plain runner), for hosts with a single device.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
           "Explain what a CPU does in one sentence.", "Name two rivers in Europe.", "What is 12 times 7?",
           "Give a synonym for happy.", "Describe a cat in five words."]


def model_args(argv: list[str], tp: int):
    """The settings ``dualserve generate`` builds from these model flags, at ``tp`` ranks."""
    from dualserve.server.cli import model_settings

    return model_settings([*argv, "--no-compile", "--tensor-parallel-size", str(tp)])


def run(dep, decoder: str, batch: int, max_tokens: int) -> tuple[list[list[int]], float]:
    """(tokens per request, seconds) for ``batch`` greedy chat requests run together."""
    from dualserve.decoders.engine.sampling import SamplingParams

    name = next(iter(dep.models))
    tok = dep.models[name].tokenizer
    outs: list[list[int]] = []
    for i in range(batch):
        text = tok.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                       add_generation_prompt=True)
        got: list[int] = []
        dep.engine.submit(name, decoder, tok.encode(text, add_special_tokens=False),
                          SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                          lambda _, d, got=got: got.extend(d.token_ids))
        outs.append(got)
    start = time.perf_counter()
    dep.engine.run_until_idle()
    return outs, time.perf_counter() - start


def measure(dep, decoders: list[str], batch: int, max_tokens: int, repeats: int) -> dict:
    out = {}
    for decoder in decoders:
        run(dep, decoder, 1, 4)  # warm-up
        best, tokens = None, None
        for _ in range(repeats):
            tokens, seconds = run(dep, decoder, batch, max_tokens)
            best = seconds if best is None else min(best, seconds)
        out[decoder] = (tokens, sum(len(t) for t in tokens) / best)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2, help="ranks for the parallel side")
    p.add_argument("--group", action="store_true", help="run the parallel side through a process group even at --tp 1")
    p.add_argument("--decoders", nargs="+", default=["ar", "eagle", "diffusion"])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2, help="runs per measurement; the fastest counts")
    p.add_argument("--json", action="store_true")
    known, model_argv = p.parse_known_args(argv)

    from dualserve.decoders.engine.openmp import run_on_own_thread
    from dualserve.server import tensor_parallel
    from dualserve.server.cli import load_deployment

    one = run_on_own_thread(load_deployment, model_args(model_argv, 1))
    base = measure(one, known.decoders, known.batch, known.max_tokens, known.repeats)
    del one
    settings = model_args(model_argv, known.tp)
    group = tensor_parallel.start(settings, force=known.group)
    try:
        dep = run_on_own_thread(load_deployment, settings, group)
        par = measure(dep, known.decoders, known.batch, known.max_tokens, known.repeats)
    finally:
        if group is not None:
            group.shutdown()
    rows = [{"decoder": d, "tp1_tok_s": round(base[d][1], 2), f"tp{known.tp}_tok_s": round(par[d][1], 2),
             "ratio": round(par[d][1] / base[d][1], 3), "identical": base[d][0] == par[d][0]}
            for d in known.decoders]
    device, reduction = settings.model.device, settings.parallel.reduction
    info = {"host_threads": torch.get_num_threads(), "device": device, "tp": known.tp, "reduction": reduction,
            "batch": known.batch, "max_tokens": known.max_tokens, "rows": rows}
    if known.json:
        print(json.dumps(info))
        return 0
    print(f"device {device}, tp {known.tp} ({reduction}), batch {known.batch} x {known.max_tokens} tokens")
    print(f"{'decoder':<10} {'tp1 tok/s':>10} {'tp' + str(known.tp) + ' tok/s':>10} {'ratio':>6}  identical")
    for r in rows:
        tp = r[f"tp{known.tp}_tok_s"]
        print(f"{r['decoder']:<10} {r['tp1_tok_s']:>10} {tp:>10} {r['ratio']:>6}  {r['identical']}")
    return 0


if __name__ == "__main__":
    from dualserve.models.errors import one_line

    raise SystemExit(one_line(main))
