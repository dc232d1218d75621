"""The mistakes a command line can name (a model path that is no model, a file that is missing, a
model this build does not load) and the one line each becomes there, instead of a traceback.

Every command of the project (``dualserve``, its trainers, the ``clients`` scripts) runs its
``main`` through ``one_line``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

from .hub import ModelFetchError


class UnsupportedModel(ValueError):
    """A checkpoint of a family or format this build does not load; the message names it and what is
    supported (the CLI prints it as one line)."""


class InputError(ValueError):
    """A file or value the user gave that cannot be used; the message names it."""


INPUT_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, ModelFetchError, UnsupportedModel,
                InputError)


def one_line(main: Callable[[], int | None], prog: str | None = None) -> int:
    """``main()``'s exit status; an input mistake is printed as ``prog: message`` and exits 2.
    ``prog``: by default, how the module was run (``python -m dualserve.clients.bench_forward``)."""
    try:
        return main() or 0
    except INPUT_ERRORS as e:
        text = str(e) if not isinstance(e, OSError) or not e.filename else f"{e.filename}: {e.strerror}"
        print(f"{prog or program(main)}: {text}", file=sys.stderr)
        return 2


def program(main: Callable) -> str:
    spec = getattr(sys.modules.get(main.__module__), "__spec__", None)
    return f"python -m {spec.name}" if spec is not None else Path(sys.argv[0]).name
