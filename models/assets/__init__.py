"""Small artifacts shipped with the package: the default model's EAGLE head, diffusion twin and
datastore of answers for suffix drafts.

The head and the twin are trained by commands in docs/training.md (``dualserve train-eagle``,
``dualserve train-diffusion``); the datastore holds the self-distilled answers they trained on
(``decoders.eagle.datastore``). All are committed because they are small.
"""

from __future__ import annotations

from pathlib import Path

from dualserve.models.hub import DEFAULT_MODEL_NAME

ASSETS = Path(__file__).parent
BUNDLED_EAGLE = {DEFAULT_MODEL_NAME: ASSETS / "eagle-smollm2"}
BUNDLED_TWIN = {DEFAULT_MODEL_NAME: ASSETS / "twin-smollm2"}
BUNDLED_DATASTORE = {DEFAULT_MODEL_NAME: ASSETS / "datastore-smollm2" / "answers.npz"}


def default_eagle_head(model_name: str) -> Path | None:
    # A GGUF served by path is named after its file, e.g. "SmolLM2-135M-Instruct.Q4_1".
    path = BUNDLED_EAGLE.get(model_name) or BUNDLED_EAGLE.get(model_name.split(".")[0])
    return path if path is not None and (path / "config.json").exists() else None


def default_twin(model_name: str) -> Path | None:
    path = BUNDLED_TWIN.get(model_name) or BUNDLED_TWIN.get(model_name.split(".")[0])
    return path if path is not None and (path / "config.json").exists() else None


def default_datastore(model_name: str) -> Path | None:
    path = BUNDLED_DATASTORE.get(model_name) or BUNDLED_DATASTORE.get(model_name.split(".")[0])
    return path if path is not None and path.exists() else None
