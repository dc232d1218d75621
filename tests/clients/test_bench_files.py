"""The compared GGUF files (clients/bench_files.py): quantized variants, with llama-quantize stood in for."""

from __future__ import annotations

from pathlib import Path

import pytest

from dualserve.clients import bench_files as bf


def test_quantize_command_and_cache_path(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    cmd = bf.quantize_command(Path("/b/llama-quantize"), gguf, Path("/o.gguf"), "Q4_K_M", 2)
    assert cmd == ["/b/llama-quantize", "--allow-requantize", str(gguf), "/o.gguf", "Q4_K_M", "2"]
    p = bf.quantized_path(tmp_path / "cache", gguf, "Q4_0")
    assert p.parent == tmp_path / "cache" / "llama.cpp" / "quantized"
    assert p.name.startswith("m-") and p.name.endswith(".Q4_0.gguf")
    gguf.write_bytes(b"GGUF, changed")
    assert bf.quantized_path(tmp_path / "cache", gguf, "Q4_0") != p


def fake_quantize(tmp_path: Path, code: int = 0) -> Path:
    """A stand-in for llama-quantize: --allow-requantize IN OUT TYPE THREADS, copying IN to OUT."""
    exe = tmp_path / f"llama-quantize-{code}"
    exe.write_text(f'#!/bin/sh\ncp "$2" "$3" && echo "$4" >> "$3"\nexit {code}\n')
    exe.chmod(0o755)
    return exe


def test_quantized_file_is_made_once_and_only_whole(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    cache, logs = tmp_path / "cache", tmp_path
    made = bf.quantized_file(fake_quantize(tmp_path), cache, gguf, "Q4_0", 2, logs)
    assert made == bf.quantized_path(cache, gguf, "Q4_0") and made.read_bytes() == b"GGUFQ4_0\n"
    # reused: a failing quantizer is not even run
    assert bf.quantized_file(fake_quantize(tmp_path, 1), cache, gguf, "Q4_0", 2, logs) == made
    with pytest.raises(RuntimeError, match="llama-quantize Q8_0 failed"):
        bf.quantized_file(fake_quantize(tmp_path, 1), cache, gguf, "Q8_0", 2, logs)
    assert not bf.quantized_path(cache, gguf, "Q8_0").exists()
    assert list(made.parent.glob("*.partial")) == []
