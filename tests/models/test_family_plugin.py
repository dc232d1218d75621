"""A family is one plug-in: its row in ``models/families.py`` and its own files, nothing else.

The code under ``server/``, ``decoders/`` and ``models/`` asks the row (``families.family``) for
anything about a family; it never names one or tests a network's class. This greps for both:

  * a family's name, model type, GGUF architecture or checkpoint class as a string in code
    (docstrings and comments may cite a paper or an upstream file by its model's name; code may
    not branch on one), outside ``families.py`` and the files the row lists as its own;
  * ``isinstance`` / ``issubclass`` against a class of a family with a network of its own (one
    imported from its own files). The core's families share the core's classes: a twin's LoRA
    layers are core layers with an adapter, which the core's sharder splits like any other.

Words that only look like a family are not hits: llama.cpp's names (``llama.cpp``, ``llamacpp``,
``llama-server``), hyphenated names of models and vocabularies (``qwen3-reranker``,
``llama-bpe``), and the GGUF tokenizer kinds ``tokenizer.py`` reads (``NOT_FAMILIES``).

It also checks that loading runs one way: no two modules of one folder import each other (lazy
imports included) in ``models/``, nor the CLI and tensor parallelism's start-up.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from dualserve.decoders.deployment import DECODERS
from dualserve.models.families import FAMILIES, family, read_config

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("server", "decoders", "models")
ALLOWED = {"models/families.py", *(f for row in FAMILIES for f in row.own_files)}
# (file, word): GGUF's tokenizer.ggml.model / .pre values, llama.cpp's vocabulary kinds, not families.
NOT_FAMILIES = {("models/tokenizer.py", "llama"), ("models/tokenizer.py", "qwen2")}
NOT_WORDS = re.compile(r"llama\.cpp|llamacpp|llama-server", re.IGNORECASE)


def family_words() -> set[str]:
    words: set[str] = set()
    for row in FAMILIES:
        words |= {row.name, *row.hf_model_types, *row.hf_classes}
        words |= {w for w in (row.gguf_architecture, row.hf_model_type, row.hf_architecture) if w}
    return words


def sources() -> list[tuple[str, ast.Module]]:
    out = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            out.append((path.relative_to(ROOT).as_posix(), ast.parse(path.read_text())))
    return out


def docstrings(tree: ast.Module) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)):
            found.add(id(body[0].value))
    return found


def name_hits(rel: str, tree: ast.Module, pattern: re.Pattern) -> list[str]:
    skip = docstrings(tree)
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            for m in pattern.finditer(NOT_WORDS.sub("", node.value)):
                if (rel, m.group(0)) not in NOT_FAMILIES:
                    hits.append(f"{rel}:{node.lineno}: {m.group(0)!r} in {node.value[:60]!r}")
    return hits


def own_modules() -> set[str]:
    """Dotted module names of the own files of families with a network of their own
    (``models/diffusion_gemma.py`` -> ``models.diffusion_gemma``)."""
    return {f.removesuffix(".py").replace("/", ".") for row in FAMILIES if not row.core for f in row.own_files}


def module_of(rel: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return (node.module or "").removeprefix("dualserve.")
    package = rel.removesuffix(".py").split("/")[:-1]
    package = package[:len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def isinstance_hits(rel: str, tree: ast.Module, own: set[str]) -> list[str]:
    classes = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
               and module_of(rel, node) in own for alias in node.names}
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("isinstance",
                                                                                                "issubclass"):
            tested = node.args[1] if len(node.args) > 1 else None
            names = [e for e in (tested.elts if isinstance(tested, ast.Tuple) else [tested]) if e is not None]
            for n in names:
                if isinstance(n, ast.Name) and n.id in classes:
                    hits.append(f"{rel}:{node.lineno}: isinstance of {n.id}")
    return hits


def test_no_family_named_outside_its_row_and_files() -> None:
    words = family_words()
    pattern = re.compile(r"(?<![\w-])(" + "|".join(sorted(map(re.escape, words), key=len, reverse=True))
                         + r")(?![\w-])")
    own = own_modules()
    hits = []
    for rel, tree in sources():
        if rel in ALLOWED:
            continue
        hits += name_hits(rel, tree, pattern) + isinstance_hits(rel, tree, own)
    assert not hits, "family named or tested outside families.py and its own files:\n" + "\n".join(hits)


def test_the_grep_finds_what_it_looks_for() -> None:
    """The checks above do find a family's name in code and a test of a family's class."""
    words = family_words()
    pattern = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, words)) + r")(?![\w-])")
    code = ast.parse('"""Cites LLaDA and llada."""\n'
                     'from .diffusion_gemma import DiffusionGemma\n'
                     'if config.family == "llada" or meta.get(f"gemma3.{k}"):\n'
                     '    ok = isinstance(model, DiffusionGemma) and "llama.cpp" and "qwen3-reranker"\n')
    hits = name_hits("models/x.py", code, pattern) + isinstance_hits("models/x.py", code, {"models.diffusion_gemma"})
    assert [h.split(": ")[1] for h in hits] == ["'llada' in 'llada'", "'gemma3' in 'gemma3.'",
                                               "isinstance of DiffusionGemma"], hits


def test_rows_are_complete() -> None:
    for row in FAMILIES:
        assert all((ROOT / f).is_file() for f in row.own_files), row.name
        assert set(row.decoders) <= set(DECODERS), row.name
        assert not (row.compiles and not row.core), f"{row.name}: only the transformer core compiles"
        assert family(row.name) is row


def test_sdar_reads_as_block_diffusion_with_qk_norm() -> None:
    """SDAR: Qwen3's layer (q/k norms, no biases), block-causal over block_size, its own [MASK]."""
    raw = {"model_type": "sdar", "architectures": ["SDARForCausalLM"], "vocab_size": 64, "hidden_size": 32,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
           "intermediate_size": 64, "attention_bias": False, "block_size": 4, "mask_token_id": 63}
    cfg = read_config(raw)
    assert (cfg.qk_norm, cfg.attention_bias, cfg.diffusion_block_size, cfg.mask_token_id, cfg.shift_logits) == (
        True, False, 4, 63, False)
    assert cfg.is_diffusion and family(cfg.family).decoders == ("masked_diffusion",)


# ---- import circles ----------------------------------------------------------------------------


def imports(rel: str, tree: ast.Module) -> set[str]:
    """Dotted modules ``rel`` imports (anywhere in the file), with ``from m import n`` also as ``m.n``."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.removeprefix("dualserve.") for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            module = module_of(rel, node)
            out |= {module} | {f"{module}.{a.name}" for a in node.names}
    return out


@pytest.mark.parametrize("pair", [("server.cli", "server.tensor_parallel"),
                                  ("models.sharding", "models.sharding_gemma"),
                                  ("models.diffusion_gemma", "models.checkpoint")])
def test_no_import_circle(pair: tuple[str, str]) -> None:
    graph = {rel.removesuffix(".py").replace("/", "."): imports(rel, tree) for rel, tree in sources()}
    a, b = pair
    assert not (b in graph[a] and a in graph[b]), f"{a} and {b} import each other"


def test_models_has_no_two_module_circle() -> None:
    graph = {rel.removesuffix(".py").replace("/", "."): imports(rel, tree) for rel, tree in sources()
             if rel.startswith("models/")}
    circles = sorted({tuple(sorted((a, b))) for a, outs in graph.items() for b in outs
                      if b != a and b in graph and a in graph[b]})
    assert not circles, circles
