"""``POST /v1/fim/completions`` (the FIM shape Mistral and DeepSeek serve): a completion with a suffix."""

from __future__ import annotations

ROUTES: list = []
