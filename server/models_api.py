"""Several models in one server: ``/models``, ``/models/load``, ``/models/unload``."""

from __future__ import annotations

ROUTES: list = []
