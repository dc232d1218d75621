"""The ways users install: the Dockerfile's steps, run here as they run in the image.

The Dockerfile copies a list of paths into ``/app`` and runs ``pip install .`` there, a
non-editable install. This test copies the same paths (read from the Dockerfile, so the two cannot
drift) into an empty folder, installs them the same way into a fresh virtual environment, and then,
from a directory that is not the checkout: imports every module of the installed package, and
starts ``dualserve serve`` to answer ``/health`` and one chat request through the openai SDK. The
editable install the suite runs from hides a wheel that lacks a package or a data file; this does not.

The environment sees the suite's site-packages (``--system-site-packages``), so torch and the
other dependencies are not downloaded again; pip still resolves the package's dependencies against
them, and every module is checked to come from the new environment, not the checkout.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dualserve.models import kernels
from server_fixture import free_port, stop, wait_healthy

ROOT = Path(__file__).resolve().parents[1]

# Every module of the installed package, imported in the new environment; prints where each came from.
IMPORT_ALL = """
import importlib, pkgutil, sys
roots = ["dualserve.server", "dualserve.decoders", "dualserve.models", "dualserve.clients"]
failed, files = [], set()
for root in roots:
    pkg = importlib.import_module(root)
    files.add(pkg.__file__)
    for info in pkgutil.walk_packages(pkg.__path__, root + "."):
        try:
            files.add(importlib.import_module(info.name).__file__)
        except Exception as e:  # noqa: BLE001 (every failure is reported)
            failed.append(f"{info.name}: {type(e).__name__}: {e}")
print("FILES", *sorted(files), sep="\\n")
if failed:
    sys.exit("\\n".join(["could not import:", *failed]))
"""


def dockerfile_steps() -> tuple[list[str], str]:
    """The paths the Dockerfile copies into the image, and its install command (the CPU image's)."""
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    copied = []
    for line in lines:
        words = shlex.split(line) if line.startswith("COPY ") else []
        copied += [w for w in words[1:-1] if not w.startswith("--")]
    install = next(line for line in lines if "pip install ." in line)
    assert copied, "the Dockerfile copies nothing"
    return copied, install


def run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 600) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A fresh virtual environment with the package installed from the Dockerfile's copy of the tree."""
    base = tmp_path_factory.mktemp("install")
    app = base / "app"
    app.mkdir()
    copied, _ = dockerfile_steps()
    for name in copied:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, app / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, app / name)
    venv = base / "venv"
    # No pip of its own: the venv module's bundled setuptools would shadow the suite's (too old to
    # build a wheel); the suite's pip installs into it with --python.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
    env["VIRTUAL_ENV"] = str(venv)
    # The Dockerfile's `pip install .`, non-editable; without build isolation it needs no network.
    run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
         "--no-build-isolation", "."], app, env)
    return venv, env


def test_the_dockerfile_installs_the_package_non_editable():
    _, install = dockerfile_steps()
    assert "-e " not in install and "--editable" not in install


def test_every_module_imports_from_the_installed_package(installed, tmp_path: Path):
    venv, env = installed
    out = run([str(venv / "bin" / "python"), "-c", IMPORT_ALL], tmp_path, env)
    files = [line for line in out.splitlines()[1:] if line.strip()]
    assert files and all(f.startswith(str(venv)) for f in files), \
        f"modules imported from outside the new environment: {[f for f in files if not f.startswith(str(venv))][:5]}"


def test_installed_package_carries_its_data_files(installed, tmp_path: Path):
    """The kernels' sources and headers, the bundled EAGLE head, twin and datastore, the prompts."""
    venv, env = installed
    script = ("from dualserve.models import kernels, assets; import dualserve.clients as c, pathlib\n"
              "print(all(h.exists() for h in kernels.HEADERS))\n"
              "print(len(list(pathlib.Path(assets.__file__).parent.glob('*/*'))))\n"
              "print(len(list(pathlib.Path(c.__file__).parent.glob('prompts/*'))))\n")
    headers, assets, prompts = run([str(venv / "bin" / "python"), "-c", script], tmp_path, env).split()
    assert headers == "True" and int(assets) > 0 and int(prompts) > 0


@pytest.mark.slow
def test_the_installed_server_answers_chat(installed, cache_dir: Path, default_gguf: Path, tmp_path: Path):
    """`dualserve serve` from the new environment, started outside the checkout, as a user runs it."""
    import openai

    venv, env = installed
    port = free_port()
    log = tmp_path / "serve.log"
    # The bundled head, twin and datastore load from the installed package; the format is pinned as
    # the shared server fixture pins it (the format choice has tests of its own).
    cmd = [str(venv / "bin" / "dualserve"), "serve", "--port", str(port), "--cache-dir", str(cache_dir),
           "--no-compile", "--quantization", "w4a16" if kernels.available() else "int4"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300, max_retries=0)
        reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=8, temperature=0,
                                               messages=[{"role": "user", "content": "What is 2+2?"}])
        assert reply.choices[0].message.content
    finally:
        stop(proc)
