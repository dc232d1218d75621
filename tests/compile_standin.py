"""A stand-in for a package build's compiler, for the tests of what ends a build.

Saved by ``aoti.build`` as the module to build, it is unpickled in the build's child process,
where it starts a long-running grandchild (``sleep``, standing in for ``cc1plus`` under ``g++``),
writes the grandchild's pid to a file and waits for it, as the child waits for its compiler.
Nothing is exported or compiled.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


class Compiler:
    """Pickles as a call of ``compile_forever``: unpickling it in the child starts the compiler."""

    def __init__(self, pidfile: Path):
        self.pidfile = pidfile

    def __reduce__(self):
        return compile_forever, (str(self.pidfile),)


def compile_forever(pidfile: str) -> None:
    proc = subprocess.Popen(["sleep", "300"])
    tmp = f"{pidfile}.tmp"
    Path(tmp).write_text(str(proc.pid))
    os.replace(tmp, pidfile)  # whole, so the test never reads half a pid
    proc.wait()
