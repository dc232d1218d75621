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
