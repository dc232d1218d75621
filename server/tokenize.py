"""llama.cpp's ``/tokenize``, ``/detokenize``, ``/apply-template`` and token counting."""

from __future__ import annotations

ROUTES: list = []
