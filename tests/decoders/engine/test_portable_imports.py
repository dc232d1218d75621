"""The engine imports on every platform pyproject names (Windows included): no POSIX-only module
(``fcntl``) may be needed at import time; a lock or a process check that needs one takes it where
it is used, with a fallback elsewhere."""

from __future__ import annotations

import subprocess
import sys
import textwrap


ENGINE = ["dualserve.decoders.engine." + m for m in (
    "admission", "blocks", "decoder", "detokenize", "engine", "grammar", "isolation", "openmp", "parallel",
    "request", "runner", "sampling", "scheduler", "attention.padded", "attention.paged_attention",
    "attention.windowed", "compile.aoti", "compile.aoti_build", "compile.compile_worker", "compile.compiled",
    "compile.cuda_graphs", "compile.cuda_shaped", "compile.step_graph", "compile.tracing")] + [
    "dualserve.decoders.deployment"]

# Imports each module named on the command line in a fresh interpreter where ``fcntl`` is missing.
WITHOUT_FCNTL = textwrap.dedent("""
    import importlib, sys

    class Missing:
        def find_spec(self, name, path=None, target=None):
            if name == "fcntl":
                raise ModuleNotFoundError("No module named 'fcntl'", name=name)
            return None

    sys.meta_path.insert(0, Missing())
    sys.modules.pop("fcntl", None)
    failed = []
    for module in sys.argv[1:]:
        try:
            importlib.import_module(module)
        except ImportError as e:
            failed.append(f"{module}: {e}")
    print("\\n".join(failed))
    sys.exit(1 if failed else 0)
""")


def imports_without_fcntl(modules: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT_FCNTL, *modules], capture_output=True, text=True,
                          timeout=300)


def test_the_engine_s_own_modules_need_no_fcntl():
    """The engine loop, scheduler, pool and compile machinery (aoti's build cleanup included)."""
    own = [m for m in ENGINE if m.removeprefix("dualserve.decoders.engine.") in (
        "admission", "compile.aoti", "compile.aoti_build", "blocks", "compile.compile_worker", "compile.tracing",
        "decoder", "detokenize", "engine", "grammar", "isolation", "request", "sampling", "scheduler")]
    done = imports_without_fcntl(own)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_engine_module_imports_without_fcntl():
    done = imports_without_fcntl(ENGINE)
    assert done.returncode == 0, done.stdout + done.stderr
