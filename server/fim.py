"""Infilling prompts for IDE plugins: llama.cpp's ``POST /infill`` and ``suffix`` on /v1/completions.

A diffusion decoder infills natively: the suffix is fixed context to the right
of the canvas. An AR decoder can only approximate it with fill-in-the-middle
special tokens (StarCoder's ``<fim_prefix>``/``<fim_suffix>``/``<fim_middle>``,
Qwen's ``<|fim_prefix|>``...), which we use when the tokenizer has them, as
llama.cpp does (its ``format_infill``). ``input_extra`` chunks (other files
the plugin sends for context) are prepended as ``<file_sep>``-style context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FIM_TOKEN_SETS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<PRE>", "<SUF>", "<MID>"),
)
FILE_SEP_TOKENS = ("<|file_sep|>", "<file_sep>")


@dataclass(frozen=True)
class InfillPrompt:
    prefix_ids: list[int]
    suffix_ids: list[int]       # empty when the suffix was folded into FIM tokens


def fim_tokens(tokenizer) -> tuple[str, str, str] | None:
    for triple in FIM_TOKEN_SETS:
        if all(tokenizer.token_to_id(t) is not None for t in triple):
            return triple
    return None


def extra_context(tokenizer, extra: list[dict[str, Any]]) -> str:
    if not extra:
        return ""
    sep = next((t for t in FILE_SEP_TOKENS if tokenizer.token_to_id(t) is not None), "\n")
    parts = []
    for chunk in extra:
        name = str(chunk.get("filename", ""))
        parts.append(f"{sep}{name}\n{chunk.get('text', '')}")
    return "".join(parts) + sep


def build_infill(tokenizer, prefix: str, suffix: str, extra: list[dict[str, Any]], native: bool) -> InfillPrompt:
    """Prompt ids for infilling; ``native`` keeps the suffix as separate right context (diffusion)."""
    context = extra_context(tokenizer, extra)
    if native:
        return InfillPrompt(tokenizer.encode(context + prefix, add_special_tokens=True),
                            tokenizer.encode(suffix, add_special_tokens=False))
    fim = fim_tokens(tokenizer)
    if fim is None:
        # No FIM vocabulary: complete the prefix and let the suffix go unused.
        return InfillPrompt(tokenizer.encode(context + prefix, add_special_tokens=True), [])
    pre, suf, mid = fim
    text = f"{context}{pre}{prefix}{suf}{suffix}{mid}"
    return InfillPrompt(tokenizer.encode(text, add_special_tokens=False), [])
