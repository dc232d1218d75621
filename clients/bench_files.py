"""The GGUF files the comparison runs on: the default model's file in the cache, and quantized
variants made from a GGUF with ``llama-quantize --allow-requantize``, kept in the cache and reused.
"""

from __future__ import annotations

import hashlib
import shlex
import subprocess
import sys
from pathlib import Path


def default_gguf(cache_dir: str | None) -> Path:
    from dualserve.models.hub import default_cache_dir, default_gguf_path

    return default_gguf_path(default_cache_dir(cache_dir))


def quantized_path(cache_dir: Path, gguf: Path, qtype: str) -> Path:
    """Where ``gguf`` quantized to ``qtype`` is kept; the name carries the source file's identity
    (path, size, mtime), so a changed or different source of the same name is quantized anew."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:8]
    return cache_dir / "llama.cpp" / "quantized" / f"{gguf.stem}-{key}.{qtype}.gguf"


def quantize_command(quantize: Path, src: Path, dst: Path, qtype: str, threads: int) -> list[str]:
    return [str(quantize), "--allow-requantize", str(src), str(dst), qtype, str(threads)]


def quantized_file(quantize: Path, cache_dir: Path, gguf: Path, qtype: str, threads: int, log_dir: Path) -> Path:
    """``gguf`` quantized to ``qtype``, made unless the cache has it."""
    dst = quantized_path(cache_dir, gguf, qtype)
    if dst.is_file():
        print(f"quantized {qtype}: reusing {dst}", file=sys.stderr, flush=True)
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    # Written under another name and renamed when done: a file under the final name is a whole one.
    partial = dst.with_name(dst.name + ".partial")
    cmd = quantize_command(quantize, gguf, partial, qtype, threads)
    log = log_dir / f"quantize-{qtype}.log"
    print(f"quantizing {gguf.name} to {qtype}: {shlex.join(cmd)}  (log {log})", file=sys.stderr, flush=True)
    with open(log, "wb") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
    if code:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"llama-quantize {qtype} failed with code {code}; log {log}:\n{tail}")
    partial.replace(dst)
    return dst
