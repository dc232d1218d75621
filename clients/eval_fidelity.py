"""How far each weight format's next-token distributions are from float: KL divergence on a corpus.

Run as ``python -m dualserve.clients.eval_fidelity [--formats int8 int4 w4a8] [--llama-cpp]
[--layers] [--ctx 512] [--json PATH] [--threads 2]``. Modelled on the KL-divergence mode of
llama.cpp's perplexity tool (``tools/perplexity/perplexity.cpp``, ``--kl-divergence``):

- the corpus (``prompts/fidelity.txt``, written for this tool: English prose, French, German,
  Spanish, Python, JavaScript, SQL, shell, JSON, Markdown and ChatML chat transcripts whose
  ``<|im_start|>`` / ``<|im_end|>`` encode as the tokenizer's special ids) is tokenized section by
  section (a line ``%% kind`` starts a section and is not part of the text), the ids are
  concatenated and split into chunks of ``--ctx`` tokens, and in each chunk the logits of the
  second half are scored, so every scored token sees at least ctx/2 tokens of context. As in
  llama.cpp, row ``j`` predicts token ``j + 1``, so a chunk scores ctx/2 - 1 tokens;
- the reference is the model at float32 with float weights (a GGUF's blocks dequantized);
- each format's logits come the way the server computes them: the deployment's ``ModelRunner``
  (eager) over a paged KV pool in the deployment's KV dtype (``deployment.kv_dtype_of``: bf16 for
  quantized formats), each chunk prefilled as one sequence, then ``runner.logits``. The KV dtype
  is thus part of what is measured. Compiled graphs round at the same places as eager ones
  (``models/quant.py``), so eager stands for both.

Per format: mean KL(ref || format) over scored tokens with its standard error, the 99th
percentile and maximum KL, top-1 agreement (the argmax equals the reference's), and the format's
perplexity beside the reference's; then the mean KL by kind of text. ``--formats`` takes ``bf16``
and every quantization the loader knows; ``auto`` is the format ``dualserve serve --quantization
auto`` picks on this host (``server.cli.pick_format``), printed, and measured once if it is also
named explicitly.

``--llama-cpp`` adds llama.cpp on the same GGUF (llama-cpp-python, never a dependency: imported
only here): each chunk's exact token ids are evaluated after a reset, no BOS added, all logits
kept, and scored against the same float reference. llama.cpp's own tokenization of each section
is compared with ours and the agreement reported. Its numerics are its defaults: Q4_1 weights
times activations quantized to 8 bits in blocks of 32, and an f16 KV cache.

``--layers`` adds where the error enters (``fidelity_layers``): for each quantized format, the
reference with one kind of module swapped for the format's, and the relative error of the
residual stream after each layer. ``--json PATH`` writes every figure.

On two quiet cores the default run (int8, int4, w4a8 and llama.cpp) takes under two minutes,
almost all of it 512-token forwards. Beside a busy neighbour two OpenMP threads can run several
times slower than one (each barrier waits for a descheduled thread), so time it on a quiet host.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from dualserve.models.quant import QUANTIZATIONS

from .fidelity_layers import analyse, format_layers
from .fidelity_scores import Corpus, Scores, markdown, tokenize_corpus

CORPUS = Path(__file__).parent / "prompts" / "fidelity.txt"
# format -> (load_model's quantization, compute dtype); "none" is the reference's own format. Every
# quantization the loader knows is a format here, so a new one is measured without touching this file.
FORMATS = {"none": ("none", torch.float32), "bf16": ("none", torch.bfloat16),
           **{q: (q, torch.float32) for q in QUANTIZATIONS if q != "none"}}
REFERENCE = "fp32 (reference)"
LLAMA_CPP = "llama.cpp (same GGUF)"


# ---- logits ---------------------------------------------------------------------------------

@dataclass
class Variant:
    label: str                    # the table's row name
    quantization: str             # load_model's quantization
    dtype: torch.dtype


def resolve_formats(formats: Sequence[str], path: Path, cache: Path, log: Callable[[str], None]) -> list[Variant]:
    """The formats to compare, once each; ``auto`` becomes what the server would pick here."""
    out: list[Variant] = []
    for fmt in formats:
        label = fmt
        if fmt == "auto":
            fmt = auto_format(path, cache)
            label = f"auto ({fmt})"
            log(f"auto resolves to {fmt} on this host")
        quantization, dtype = FORMATS["none" if fmt == "fp32" else fmt]
        if (quantization, dtype) != FORMATS["none"] and all((v.quantization, v.dtype) != (quantization, dtype)
                                                            for v in out):
            out.append(Variant(label, quantization, dtype))
    return out


def auto_format(path: Path, cache: Path) -> str:
    """The format ``--quantization auto`` (a CPU, ``--dtype auto``) serves ``path`` in."""
    from dualserve.server.cli import pick_format
    from dualserve.server.settings import ModelSpec

    quantization, dtype, _ = pick_format(ModelSpec(cache_dir=cache), path, cache, torch.float32)
    if quantization == "none":
        return "bf16" if dtype == torch.bfloat16 else "fp32"
    return quantization


class ChunkLogits:
    """A loaded model's logits for the scored rows of a chunk, through a ``ModelRunner`` as served."""

    def __init__(self, loaded, ctx: int, block_size: int = 16):
        from dualserve.decoders.deployment import kv_dtype_of
        from dualserve.decoders.engine.runner import ModelRunner

        blocks = -(-ctx // block_size)
        self.kv_dtype = kv_dtype_of(loaded)
        self.runner = ModelRunner(loaded.model, blocks, block_size, kv_dtype=self.kv_dtype, use_flash=False)
        self.block_table = list(range(blocks))  # block i holds positions i*bs.., so slot == position

    def __call__(self, ids: torch.Tensor, first: int) -> torch.Tensor:
        """(len(ids) - 1 - first, vocab) fp32 logits of rows first .. len(ids) - 2."""
        from dualserve.decoders.engine.runner import ForwardItem

        n = len(ids)
        item = ForwardItem(ids, range(n), 0, self.block_table, slots=range(n))
        hidden, _ = self.runner.forward([item])
        return self.runner.logits(hidden[first: n - 1])


class LlamaCppLogits:
    """llama.cpp's logits for the same token ids (llama-cpp-python, imported here only)."""

    def __init__(self, gguf: Path, ctx: int, threads: int):
        try:
            import llama_cpp
        except ImportError:
            raise SystemExit("--llama-cpp needs llama-cpp-python (pip install llama-cpp-python); "
                             "it is not a dependency of dualserve") from None
        if not (gguf.is_file() and gguf.suffix == ".gguf"):
            raise SystemExit(f"--llama-cpp needs a GGUF file, not {gguf}")
        self.llm = llama_cpp.Llama(model_path=str(gguf), logits_all=True, n_ctx=ctx, n_batch=ctx, n_ubatch=ctx,
                                   n_threads=threads, n_threads_batch=threads, verbose=False)

    def tokenize(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)

    def __call__(self, ids: torch.Tensor, first: int) -> torch.Tensor:
        n = len(ids)
        self.llm.reset()
        self.llm.eval(ids.tolist())  # exactly these ids: eval adds no BOS
        return torch.from_numpy(self.llm.scores[first: n - 1].copy())


def tokenizer_agreement(corpus: Corpus, tokenize: Callable[[str], list[int]]) -> dict:
    """How many sections the other tokenizer encodes to exactly our ids, and where the first differs."""
    same, first_diff = 0, None
    for kind, text, ids in corpus.sections:
        theirs = tokenize(text)
        if theirs == ids:
            same += 1
        elif first_diff is None:
            at = next((i for i, (a, b) in enumerate(zip(ids, theirs)) if a != b), min(len(ids), len(theirs)))
            first_diff = {"kind": kind, "index": at, "ours": ids[at: at + 5], "theirs": theirs[at: at + 5]}
    return {"sections": len(corpus.sections), "identical": same, "first_difference": first_diff}


# ---- the run --------------------------------------------------------------------------------

def score(corpus: Corpus, ctx: int, reference: ChunkLogits, models: dict[str, Callable],
          log: Callable[[str], None]) -> dict[str, Scores]:
    """Every model's scores against the reference, chunk by chunk (one chunk's logits in memory at a time)."""
    first = ctx // 2
    scores = {REFERENCE: Scores(), **{name: Scores() for name in models}}
    chunks = corpus.chunks(ctx)
    for c, (ids, kinds) in enumerate(chunks):
        targets, target_kinds = ids[first + 1:], kinds[first + 1:]
        start = time.perf_counter()
        ref_logits = reference(ids, first)
        ref_logp = torch.log_softmax(ref_logits.double(), dim=-1)
        scores[REFERENCE].seconds += time.perf_counter() - start
        scores[REFERENCE].add(ref_logp, ref_logits, targets, target_kinds)  # the same op on the same logits: KL 0
        for name, logits_of in models.items():
            start = time.perf_counter()
            logits = logits_of(ids, first)
            scores[name].seconds += time.perf_counter() - start
            scores[name].add(ref_logp, logits, targets, target_kinds)
        log(f"  chunk {c + 1}/{len(chunks)} scored")
    return scores


def evaluate(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict:
    from dualserve.models.hub import default_cache_dir, resolve_model
    from dualserve.models.loader import load_model

    torch.set_num_threads(args.threads)
    cache = default_cache_dir(args.cache_dir)
    name, path = resolve_model(args.model, cache)
    variants = resolve_formats(args.formats, path, cache, log)
    ref = load_model(path, name=name, cache_dir=cache, quantization="none")
    corpus = tokenize_corpus(ref.tokenizer, Path(args.corpus))
    chunks = len(corpus.ids) // args.ctx
    if chunks == 0:
        raise SystemExit(f"the corpus has {len(corpus.ids)} tokens, fewer than one chunk of --ctx {args.ctx}")
    log(f"{path.name}: corpus {len(corpus.ids)} tokens, {chunks} chunks of {args.ctx}, "
        f"{chunks * (args.ctx - args.ctx // 2 - 1)} scored")
    loaded, models = {}, {}
    for v in variants:
        loaded[v.label] = load_model(path, name=name, dtype=v.dtype, cache_dir=cache, quantization=v.quantization)
        models[v.label] = ChunkLogits(loaded[v.label], args.ctx)
    report: dict = {"model": str(path), "ctx": args.ctx, "threads": torch.get_num_threads(),
                    "corpus": {"path": str(args.corpus), "tokens": len(corpus.ids), "chunks": chunks,
                               "kinds": corpus.names},
                    "formats": {v.label: {"quantization": v.quantization, "dtype": str(v.dtype).removeprefix("torch."),
                                          "kv_dtype": str(models[v.label].kv_dtype).removeprefix("torch.")}
                                for v in variants}}
    if args.llama_cpp:
        llama = LlamaCppLogits(path, args.ctx, args.threads)
        if llama.llm.n_vocab() != ref.config.vocab_size:
            raise SystemExit(f"llama.cpp's vocabulary ({llama.llm.n_vocab()}) is not ours ({ref.config.vocab_size})")
        report["llama_cpp_tokenizer"] = tokenizer_agreement(corpus, llama.tokenize)
        models[LLAMA_CPP] = llama
    scores = score(corpus, args.ctx, ChunkLogits(ref, args.ctx), models, log)
    report["rows"] = {label: s.summary(corpus.names) for label, s in scores.items()}
    if args.layers:
        report["layers"] = analyse(ref, loaded, corpus, args.ctx, args.layer_tokens, log)
    return report


# ---- output ---------------------------------------------------------------------------------

def format_report(report: dict) -> str:
    rows, ref_ppl = report["rows"], report["rows"][REFERENCE]["ppl"]
    c = report["corpus"]
    lines = [f"{Path(report['model']).name}: {c['tokens']} corpus tokens, {c['chunks']} chunks of {report['ctx']}, "
             f"{rows[REFERENCE]['tokens']} scored; KL(reference || format) in nats; {report['threads']} threads", ""]
    body = [[label, f"{r['kl_mean']:.5f} ± {r['kl_se']:.5f}", f"{r['kl_p99']:.4f}", f"{r['kl_max']:.3f}",
             f"{r['top1'] * 100:.2f}% ± {r['top1_se'] * 100:.2f}", f"{r['ppl']:.3f}", f"{r['ppl'] / ref_ppl:.4f}"]
            for label, r in rows.items()]
    lines += markdown(["format", "mean KL ± se", "KL p99", "KL max", "top-1 agree", "PPL", "PPL / ref"], body)
    lines += ["", "mean KL by kind of text"]
    kinds = c["kinds"]
    body = [[label] + [f"{r['by_kind'][k]['kl_mean']:.5f}" if k in r["by_kind"] else "-" for k in kinds]
            for label, r in rows.items() if label != REFERENCE]
    lines += markdown(["format"] + kinds, body)
    if "llama_cpp_tokenizer" in report:
        t = report["llama_cpp_tokenizer"]
        lines += ["", f"llama.cpp tokenizes {t['identical']}/{t['sections']} sections to our ids"
                  + (f"; first difference: {t['first_difference']}" if t["first_difference"] else "")]
    if "layers" in report:
        lines += ["", format_layers(report["layers"])]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dualserve.clients.eval_fidelity", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model path (default: the default model's GGUF)")
    p.add_argument("--cache-dir", default=None, help="model cache (default: $DUALSERVE_CACHE or ~/.cache/dualserve)")
    p.add_argument("--formats", nargs="+", choices=[*FORMATS, "auto"], default=["int8", "int4", "w4a8"],
                   help="compared against the fp32 reference (always run); auto: the server's pick on this host")
    p.add_argument("--corpus", default=str(CORPUS), help="text with '%%%% kind' section lines")
    p.add_argument("--ctx", type=int, default=512, help="chunk length; the second half of each chunk is scored")
    p.add_argument("--llama-cpp", action="store_true", help="add llama.cpp on the same GGUF (llama-cpp-python)")
    p.add_argument("--layers", action="store_true", help="add where the error enters: module kinds and layers")
    p.add_argument("--layer-tokens", type=int, default=1024, help="tokens forwarded for --layers (whole chunks)")
    p.add_argument("--threads", type=int, default=2, help="torch (and llama.cpp) threads")
    p.add_argument("--json", default=None, help="write every figure here")
    args = p.parse_args(argv)
    if args.ctx < 4 or args.layer_tokens < 1:
        p.error("--ctx must be at least 4 and --layer-tokens at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report = evaluate(args)
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    from dualserve.models.errors import one_line

    raise SystemExit(one_line(main))
