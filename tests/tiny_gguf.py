"""Small GGUF pieces for tests: a vocabulary cut to its first tokens."""

from __future__ import annotations

from dualserve.clients import write_gguf as wg


def trimmed(fields: list[wg.MetaField], n: int = 512) -> list[wg.MetaField]:
    """The first ``n`` tokens and the merges among them: a valid BPE vocabulary small enough that a
    reader parses it in milliseconds (the full one takes seconds, in every reader, each time)."""
    meta = {f.key: f.value for f in fields}
    keep = set(meta["tokenizer.ggml.tokens"][:n])
    merges = [m for m in meta["tokenizer.ggml.merges"] if (lambda a, b: {a, b, a + b} <= keep)(*m.split(" "))]
    out = []
    for f in fields:
        if f.key == "tokenizer.ggml.merges":
            f = wg.MetaField(f.key, merges, f.vtype, f.sub_type)
        elif f.sub_type is not None and len(f.value) == len(meta["tokenizer.ggml.tokens"]):
            f = wg.MetaField(f.key, f.value[:n], f.vtype, f.sub_type)  # tokens, token types, scores
        out.append(f)
    return out
