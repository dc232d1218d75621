"""Where a weight format's error enters the model: by kind of module, and layer by layer.

Part of ``eval_fidelity --layers``. For each quantized format, over the first whole chunks of the
corpus (``--layer-tokens`` tokens forwarded, scored on the second half of each chunk as in the
main table):

- **by module kind**: the float reference with only one kind of module taken from the format's
  model (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj`` in every layer, the output
  head ``lm_head``, the embedding ``embed_tokens``), then ``kv_cache``: the float weights with
  keys and values rounded to the format's KV dtype as the paged pool stores them
  (``paged_attention.as_stored``), and ``all``: the format's model with its KV rounding, which
  should land near the main table's row. Each gives KL(reference || variant) and top-1 agreement.
  Modules are shared by reference (the format's layers are buffers only) and swapped back after
  each variant, so no model is copied. The reference's head is tied to its embedding, so when
  the embedding is swapped the head stays the float embedding matrix.
- **by layer**: the relative error ``||h_fmt - h_ref|| / ||h_ref||`` of the residual stream
  after each layer (``Transformer.forward``'s ``aux_layers``) of the ``all`` variant, computed
  per token and averaged over the scored tokens, so that no single token with a large residual
  norm can dominate. The pooled ratio (every token's error over every token's norm) is in the
  JSON too; on the default model the two agree within a few percent.

Attention here is ``DenseAttention`` (no paged pool): the runner's kernels differ from it only by
float rounding, far below the formats' errors, and the reference runs through the same path, so
a variant identical to it scores exactly zero.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import nn

from dualserve.models.attention import DenseAttention
from dualserve.models.transformer import Transformer

from .fidelity_scores import Corpus, Scores, markdown

LAYER_KINDS = {"qkv_proj": "self_attn.qkv_proj", "o_proj": "self_attn.o_proj",
               "gate_up_proj": "mlp.gate_up_proj", "down_proj": "mlp.down_proj"}
KINDS = (*LAYER_KINDS, "lm_head", "embed_tokens", "kv_cache", "all")


class StoredKV:
    """Dense causal attention over keys and values rounded to ``kv_dtype`` first, as a KV pool in
    that dtype returns them."""

    def __init__(self, n: int, kv_dtype: torch.dtype):
        self.dense = DenseAttention([n])
        self.kv_dtype = kv_dtype

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if k.dtype != self.kv_dtype:
            k, v = k.to(self.kv_dtype).to(k.dtype), v.to(self.kv_dtype).to(v.dtype)
        return self.dense(layer_idx, q, k, v)


def tied_float_head(model: Transformer) -> nn.Linear:
    """A float output head sharing the (float) embedding matrix of a tied model."""
    w = model.embed_tokens.weight
    head = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
    head.weight = nn.Parameter(w, requires_grad=False)
    return head


@contextmanager
def swapped(ref: Transformer, fmt: Transformer, kind: str) -> Iterator[Transformer]:
    """``ref`` with ``fmt``'s modules of one kind (by reference), restored on exit."""
    saved: list[tuple[nn.Module, str, nn.Module | None]] = []  # (parent, attribute, original)

    def put(parent: nn.Module, attr: str, module: nn.Module | None) -> None:
        saved.append((parent, attr, getattr(parent, attr)))
        setattr(parent, attr, module)

    if kind in LAYER_KINDS:
        owner, attr = LAYER_KINDS[kind].split(".")
        for mine, theirs in zip(ref.layers, fmt.layers):
            put(mine.get_submodule(owner), attr, theirs.get_submodule(owner).get_submodule(attr))
    elif kind == "lm_head":
        put(ref, "lm_head", fmt.lm_head if fmt.lm_head is not None else tied_float_head(fmt))
    elif kind == "embed_tokens":
        if ref.lm_head is None:  # tied: keep the float matrix as the head while the embedding changes
            put(ref, "lm_head", tied_float_head(ref))
        put(ref, "embed_tokens", fmt.embed_tokens)
    try:
        yield ref
    finally:
        for parent, attr, module in reversed(saved):
            setattr(parent, attr, module)


@torch.inference_mode()
def forward(model: Transformer, ids: torch.Tensor, first: int, kv_dtype: torch.dtype,
            aux_layers: range = range(0)) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits of the scored rows (first .. n - 2) and the residual stream after each of
    ``aux_layers`` on those rows."""
    n = len(ids)
    hidden, aux = model(ids, torch.arange(n), StoredKV(n, kv_dtype), aux_layers=aux_layers)
    return model.logits(hidden[first: n - 1]), [h[first: n - 1] for h in aux]


def relative_errors(fmt: list[list[torch.Tensor]], ref: list[list[torch.Tensor]]) -> list[dict]:
    """Per layer: the mean per-token and the pooled ||h_fmt - h_ref|| / ||h_ref||, over all chunks."""
    out = []
    for layer in range(len(ref[0])):
        h = torch.cat([chunk[layer] for chunk in ref]).double()
        d = torch.cat([chunk[layer] for chunk in fmt]).double() - h
        per_token = d.norm(dim=-1) / h.norm(dim=-1).clamp(min=1e-30)
        out.append({"layer": layer, "mean": per_token.mean().item(), "pooled": (d.norm() / h.norm()).item()})
    return out


def analyse(ref_loaded, loaded: dict, corpus: Corpus, ctx: int, layer_tokens: int,
            log: Callable[[str], None] = print) -> dict:
    """Module-kind and per-layer figures of every quantized format in ``loaded`` (label -> LoadedModel)."""
    from dualserve.decoders.deployment import kv_dtype_of

    ref = ref_loaded.model
    ref_dtype = kv_dtype_of(ref_loaded)
    chunks = corpus.chunks(ctx)[: max(1, layer_tokens // ctx)]
    first = ctx // 2
    layers = range(ref.config.num_layers)
    ref_runs = [forward(ref, ids, first, ref_dtype, layers) for ids, _ in chunks]
    ref_logps = [torch.log_softmax(logits.double(), dim=-1) for logits, _ in ref_runs]
    out = {"chunks": len(chunks), "tokens_forwarded": len(chunks) * ctx,
           "tokens_scored": len(chunks) * (ctx - first - 1), "formats": {}, "skipped": []}
    for label, fmt_loaded in loaded.items():
        if fmt_loaded.quantization == "none":  # float weights in another dtype: no modules of another format
            out["skipped"].append(label)
            continue
        fmt, kv_dtype = fmt_loaded.model, kv_dtype_of(fmt_loaded)
        kinds, fmt_aux = {}, []
        for kind in KINDS:
            scores = Scores()
            for (ids, kind_ids), ref_logp in zip(chunks, ref_logps):
                if kind == "all":
                    logits, aux = forward(fmt, ids, first, kv_dtype, layers)
                    fmt_aux.append(aux)
                else:
                    with swapped(ref, fmt, kind) as model:
                        logits, _ = forward(model, ids, first, kv_dtype if kind == "kv_cache" else ref_dtype)
                scores.add(ref_logp, logits, ids[first + 1:], kind_ids[first + 1:])
            s = scores.summary()
            kinds[kind] = {"kl_mean": s["kl_mean"], "kl_se": s["kl_se"], "top1": s["top1"]}
        kinds["sum of parts"] = {"kl_mean": sum(kinds[k]["kl_mean"] for k in KINDS if k != "all")}
        out["formats"][label] = {"kv_dtype": str(kv_dtype).removeprefix("torch."), "kinds": kinds,
                                 "layers": relative_errors(fmt_aux, [aux for _, aux in ref_runs])}
        log(f"  layers: {label} done")
    return out


def format_layers(result: dict) -> str:
    labels = list(result["formats"])
    if not labels:
        return "where the error enters: no quantized format to analyse"
    lines = [f"where the error enters: the float reference with one kind of module from the format "
             f"({result['tokens_forwarded']} tokens forwarded, {result['tokens_scored']} scored; dense attention)"]
    rows = []
    for kind in (*KINDS, "sum of parts"):
        cells = [kind]
        for label in labels:
            k = result["formats"][label]["kinds"][kind]
            cells += [f"{k['kl_mean']:.5f}", f"{k['top1'] * 100:.2f}%" if "top1" in k else ""]
        rows.append(cells)
    head = ["module"] + [c for label in labels for c in (f"{label} KL", f"{label} top-1")]
    lines += markdown(head, rows)
    lines += ["", "relative error of the residual stream after each layer (mean over tokens of "
              "||h_fmt - h_ref|| / ||h_ref||; the format's whole model)"]
    n = len(result["formats"][labels[0]]["layers"])
    rows = [[str(i)] + [f"{result['formats'][label]['layers'][i]['mean']:.5f}" for label in labels] for i in range(n)]
    lines += markdown(["layer"] + labels, rows)
    if result["skipped"]:
        lines.append(f"not analysed (float weights): {', '.join(result['skipped'])}")
    return "\n".join(lines)
