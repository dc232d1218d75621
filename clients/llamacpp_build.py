"""Find or build llama.cpp's C++ binaries (``llama-server``, ``llama-quantize``, ``llama-bench``).

Run as::

    python -m dualserve.clients.llamacpp_build --jobs 2     # builds if needed, prints the bin directory

The benchmarks compare dualserve against llama.cpp's own C++ server. The binaries come from, in
order:

1. an explicit path (``--llama-server PATH``); its sibling ``llama-quantize`` / ``llama-bench``
   are used when present;
2. ``llama-server`` on ``PATH`` (siblings the same way);
3. a build of the llama.cpp source that the ``llama-cpp-python==0.3.36`` sdist vendors, so the
   C++ server is the same llama.cpp as ``--baseline python``'s. The sdist is fetched with
   ``pip download`` (the project's only route to the network is the package registries), unpacked
   into ``<cache>/llama.cpp/src/`` and built into ``<cache>/llama.cpp/<version>-<hash>/bin/``,
   where the hash covers this CPU's flags and the build options: ``-DGGML_NATIVE=ON`` makes
   binaries for this CPU only, so another host (or other options) gets its own directory.

The build is Release, static (binaries that run from anywhere), without tests, examples, the
web UI (whose prebuilt assets would be downloaded from Hugging Face) or OpenSSL, and with
``-mno-amx-*``: llama.cpp's AMX kernels can crash (SIGILL / segfault) on Q4_1 files on CPUs that
expose AMX. A marker file is written only after every target built, so an interrupted build is
resumed (cmake rebuilds what is missing) instead of being taken for a finished one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, TextIO

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SERVER, QUANTIZE, BENCH = "llama-server", "llama-quantize", "llama-bench"
TARGETS = (SERVER, QUANTIZE, BENCH)
MARKER = "build-complete.json"
NO_AMX = ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
)


@dataclass(frozen=True)
class Binaries:
    """Where llama.cpp's tools are; ``quantize`` / ``bench`` are None where none was found."""

    server: Path
    quantize: Path | None = None
    bench: Path | None = None


# ---------------------------------------------------------------------------------------------
# Paths and commands (pure)


def cpu_flags(cpuinfo: str) -> list[str]:
    """The CPU feature flags of the first ``flags`` line of /proc/cpuinfo, sorted."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return sorted(set(value.split()))
    return []


def build_hash(flags: Sequence[str]) -> str:
    """12 hex digits over the CPU flags and every build option: a new key means a new build."""
    key = json.dumps({"cpu": sorted(flags), "cmake": CMAKE_OPTIONS, "cflags": NO_AMX, "targets": TARGETS})
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def build_dir(cache_dir: Path, flags: Sequence[str], version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    return cache_dir / "llama.cpp" / f"{version}-{build_hash(flags)}"


def source_dir(cache_dir: Path, version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """The vendored llama.cpp tree inside the unpacked sdist."""
    return cache_dir / "llama.cpp" / "src" / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"


def download_command(dest: Path, version: str = LLAMA_CPP_PYTHON_VERSION) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
            f"llama-cpp-python=={version}", "-d", str(dest)]


def configure_command(source: Path, build: Path) -> list[str]:
    flags = " ".join(NO_AMX)
    return ["cmake", "-S", str(source), "-B", str(build), *CMAKE_OPTIONS,
            f"-DCMAKE_C_FLAGS={flags}", f"-DCMAKE_CXX_FLAGS={flags}"]


def build_command(build: Path, jobs: int, targets: Sequence[str] = TARGETS) -> list[str]:
    return ["cmake", "--build", str(build), "--config", "Release", "--parallel", str(jobs),
            "--target", *targets]


def is_built(build: Path) -> bool:
    """True once the marker exists and every binary it names is still there."""
    marker = build / MARKER
    if not marker.is_file():
        return False
    return all((build / "bin" / t).is_file() for t in TARGETS)


def write_marker(build: Path, commands: Sequence[Sequence[str]]) -> None:
    record = {"version": LLAMA_CPP_PYTHON_VERSION, "commands": [list(c) for c in commands],
              "binaries": {t: str(build / "bin" / t) for t in TARGETS}}
    (build / MARKER).write_text(json.dumps(record, indent=2), encoding="utf-8")


def siblings(server: Path) -> Binaries:
    """The tools beside a given ``llama-server``, where present."""
    def beside(name: str) -> Path | None:
        p = server.parent / name
        return p if p.is_file() else None

    return Binaries(server, beside(QUANTIZE), beside(BENCH))


# ---------------------------------------------------------------------------------------------
# Fetching and building


def run_logged(cmd: Sequence[str], log: Path, out: TextIO, progress: bool = False) -> None:
    """Run cmd with its output appended to log; echo cmake's ``[ NN%]`` lines when ``progress``."""
    tail: deque[str] = deque(maxlen=30)
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace")
        assert proc.stdout is not None
        for line in proc.stdout:
            f.write(line)
            tail.append(line.rstrip())
            # "[ 42%] Building CXX object ..." from Makefile generators: one line per object built
            if progress and line.startswith("[") and "%]" in line[:8]:
                print(f"  llama.cpp build {line.rstrip()}", file=out, flush=True)
        code = proc.wait()
    if code:
        raise RuntimeError(f"{cmd[0]} {cmd[1]} failed with code {code}; log {log}:\n" + "\n".join(tail))


def fetch_source(cache_dir: Path, out: TextIO) -> Path:
    """Download and unpack the sdist unless its vendored llama.cpp is already there."""
    source = source_dir(cache_dir)
    if (source / "CMakeLists.txt").is_file():
        return source
    src_root = cache_dir / "llama.cpp" / "src"
    src_root.mkdir(parents=True, exist_ok=True)
    sdist = src_root / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    if not sdist.is_file():
        print(f"downloading the llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist into {src_root}",
              file=out, flush=True)
        run_logged(download_command(src_root), src_root / "download.log", out)
    # Unpacked beside, then renamed: a half-unpacked tree is never taken for a whole one.
    with tempfile.TemporaryDirectory(dir=src_root) as tmp:
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        shutil.move(str(Path(tmp) / source.parents[1].name), str(source.parents[1]))
    return source


def build(cache_dir: Path, jobs: int, out: TextIO = sys.stderr, flags: Sequence[str] | None = None) -> Path:
    """Build the targets into the cache unless a finished build is there; returns the build dir."""
    flags = cpu_flags(Path("/proc/cpuinfo").read_text()) if flags is None else flags
    target = build_dir(cache_dir, flags)
    if is_built(target):
        return target
    source = fetch_source(cache_dir, out)
    target.mkdir(parents=True, exist_ok=True)
    log = target / "build.log"
    commands = [configure_command(source, target), build_command(target, jobs)]
    print(f"building llama.cpp ({', '.join(TARGETS)}) into {target}, log {log}; "
          "this takes many minutes", file=out, flush=True)
    for cmd in commands:
        run_logged(cmd, log, out, progress=True)
    write_marker(target, commands)
    return target


def find_binaries(explicit: Path | None, cache_dir: Path, jobs: int, out: TextIO = sys.stderr) -> Binaries:
    """The given server, else ``llama-server`` on PATH, else a build in the cache (see the docstring)."""
    if explicit is not None:
        if not explicit.is_file():
            raise SystemExit(f"--llama-server {explicit}: no such file")
        return siblings(explicit)
    on_path = shutil.which(SERVER)
    if on_path:
        return siblings(Path(on_path))
    bin_dir = build(cache_dir, jobs, out) / "bin"
    return Binaries(bin_dir / SERVER, bin_dir / QUANTIZE, bin_dir / BENCH)


def main(argv: Sequence[str] | None = None) -> int:
    from dualserve.models.hub import default_cache_dir

    p = argparse.ArgumentParser(prog="python -m dualserve.clients.llamacpp_build", description=__doc__.split("\n")[0])
    p.add_argument("--cache-dir", default=None, help="dualserve cache (default: the model cache)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compile jobs (default: all cores)")
    args = p.parse_args(argv)
    target = build(default_cache_dir(args.cache_dir), args.jobs)
    print(target / "bin")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
