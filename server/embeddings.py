"""OpenAI's ``POST /v1/embeddings``: texts or token ids -> pooled vectors."""

from __future__ import annotations

ROUTES: list = []
