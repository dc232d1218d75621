"""Shared fixtures: the default model file, fetched once into a cache shared by all tests."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
import torch

from dualserve.models.hub import default_cache_dir, pull_default_model


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models run faster on one thread: thread hand-off costs more than their matmuls save,
    badly so on a busy 2-core machine. Modules opt in with ``pytestmark``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    return default_cache_dir()


@pytest.fixture(scope="session")
def default_gguf(cache_dir: Path) -> Path:
    """Path to SmolLM2-135M-Instruct.Q4_1.gguf (downloaded on first use)."""
    return pull_default_model(cache_dir, quiet=True)


# A real server in a subprocess, shared by every test module that needs one (server/, clients/).
from server_fixture import server_url  # noqa: E402,F401
