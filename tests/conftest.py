"""Shared fixtures: the default model file, fetched once into a cache shared by all tests."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest
import torch

from dualserve.models.hub import default_cache_dir, pull_default_model


def pytest_xdist_auto_num_workers(config) -> int:
    """Two test files run at once (most of a graph build is one core's work: a compiler, a
    child process), or one on a single core. More workers than that would only share the same
    two cores' time among more servers and models in memory."""
    return min(2, os.cpu_count() or 1)


if os.environ.get("PYTEST_XDIST_WORKER"):
    # Each of two workers runs torch on one thread: two teams of two on two cores wait at every
    # barrier for a thread the other worker's team holds (a default-model test took 107 s so,
    # 15 s alone). Tests of the threads themselves set their own; servers the tests start choose
    # theirs as a server does.
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models run faster on one thread: thread hand-off costs more than their matmuls save,
    badly so on a busy 2-core machine. Modules opt in with ``pytestmark``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def torch_config() -> dict[str, dict]:
    import torch._dynamo  # noqa: F401  (its config module)
    import torch._inductor.config

    return {"dynamo": torch._dynamo.config.get_config_copy(), "inductor": torch._inductor.config.get_config_copy()}


@pytest.fixture(autouse=True)
def torch_config_unchanged() -> Iterator[None]:
    """No test leaves torch's global compiler config changed: a later compile anywhere in the run
    would see it (the suite must pass in any order). Patch it as a context instead."""
    before = torch_config()
    yield
    after = torch_config()
    changed = [f"{part}.{key}" for part in before for key in before[part]
               if after[part].get(key, "<missing>") != before[part][key]]
    assert not changed, f"the test changed torch's compiler config: {', '.join(changed)}"


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    return default_cache_dir()


@pytest.fixture(scope="session")
def default_gguf(cache_dir: Path) -> Path:
    """Path to SmolLM2-135M-Instruct.Q4_1.gguf (downloaded on first use)."""
    return pull_default_model(cache_dir, quiet=True)


# A real server in a subprocess, shared by every test module that needs one (server/, clients/).
from server_fixture import server_url  # noqa: E402,F401
