"""The package's layering: no two modules of one folder import each other (lazy imports inside
functions count), so each folder reads as a set of files with one direction between any two."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("server", "decoders", "models", "clients")


def modules() -> dict[str, Path]:
    found = {}
    for top in PACKAGES:
        for path in (ROOT / top).rglob("*.py"):
            name = ".".join(("dualserve", *path.relative_to(ROOT).with_suffix("").parts))
            found[name.removesuffix(".__init__")] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                out.add(target if target in known else base)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {m for m in out if m in known and m != name}


def test_no_two_modules_of_a_folder_import_each_other():
    known = modules()
    deps = {name: imports(name, path, known) for name, path in known.items()}
    circles = [f"{a} <-> {b}" for a, b in itertools.combinations(sorted(known), 2)
               if a.rsplit(".", 1)[0] == b.rsplit(".", 1)[0] and b in deps[a] and a in deps[b]]
    assert not circles, "\n".join(circles)
