"""``POST /v1/rerank`` (llama.cpp, Jina and Cohere shapes): a query and documents -> relevance scores."""

from __future__ import annotations

ROUTES: list = []
