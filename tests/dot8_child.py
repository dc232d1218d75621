"""Run dot8 layers in a fresh process: the kernel reads its environment (code path, AMX) once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch


def run_in_child(tmp_path: Path, layers: dict, x: torch.Tensor, env: dict[str, str],
                 rows: tuple[int, ...] | None = None, report: str = "code_path") -> tuple[str, dict]:
    """Each layer applied to ``x`` (or, with ``rows``, to ``x[:r]`` for each r: a list) in a child
    under ``env``; returns what ``kernels.<report>()`` said there, and the outputs by layer name."""
    torch.save({"layers": layers, "x": x, "rows": rows}, tmp_path / "job.pt")
    code = ("import sys, torch; from dualserve.models import kernels; kernels.available(); "
            "job = torch.load(sys.argv[1], weights_only=False); x, rows = job['x'], job['rows']; "
            "torch.save({k: l(x) if rows is None else [l(x[:r]) for r in rows] for k, l in job['layers'].items()}, "
            f"sys.argv[2]); print(kernels.{report}())")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "job.pt"), str(tmp_path / "out.pt")],
                          env={**os.environ, **env}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()[-1], torch.load(tmp_path / "out.pt")
