"""``--quantization auto`` decides the weight format once per host, and every later start keeps it.

Each branch of the first decision is driven through ``cli.pick_format`` with the CPU's dot8 path,
the cost table and the host key injected (``formats.HostProbe``; nothing is timed): the CPU's
integer dot-product path, a quiet measurement, a busy one. The key case is a busy first start and
a quiet second one: both serve the same format, the second decides nothing, and the compiled-graph
package keys of the model each loads are the same (nothing would be built again).
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_twin import write_tiny_llama

from dualserve.decoders.engine.compile import aoti
from dualserve.models import formats
from dualserve.models.formats import FormatTable, HostProbe
from dualserve.models.loader import load_model
from dualserve.server import cli
from dualserve.server.cli import model_settings, pick_format

# On this table a quiet host picks int4 (the float checkpoint's fp32 is slower by far).
MS = {"fp32": 40.0, "bf16": 30.0, "int8": 12.0, "int4": 10.0}


def table(neighbour_cores: float) -> FormatTable:
    return FormatTable("test", {f: {"1": v, "8": v} for f, v in MS.items()}, neighbour_cores)


QUIET, BUSY = table(0.0), table(1.5)


class Host:
    """A host as ``pick_format`` sees it: its dot8 path, what each measurement returns, its key;
    counts the measurements and the looks at the CPU."""

    def __init__(self, dot8: str, tables: list[FormatTable], key: str = "avx512-amx0-bf160-t2-torchX-kernelsA"):
        self.dot8, self.tables, self.key = dot8, list(tables), key
        self.measured = self.asked_cpu = 0

    def probe(self) -> HostProbe:
        def measure(_config) -> FormatTable:
            self.measured += 1
            return self.tables.pop(0)

        def path() -> str:
            self.asked_cpu += 1
            return self.dot8

        return HostProbe(dot8_path=path, measure=measure, key=lambda: self.key)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"))


def start(model_dir: Path, cache: Path, host: Host, *flags: str):
    """One start's format: (quantization, dtype, table) as ``pick_format`` returns them."""
    spec = model_settings(["--model", str(model_dir), "--device", "cpu", "--cache-dir", str(cache), *flags]).model
    return pick_format(spec, model_dir, cache, torch.float32, host.probe())


@pytest.mark.parametrize("dot8", ["avx512_vnni", "avx2"])
def test_a_cpu_with_a_vector_dot8_path_serves_w4a16_even_when_busy(model_dir, tmp_path, dot8):
    host = Host(dot8, [BUSY])
    quantization, dtype, served_table = start(model_dir, tmp_path, host)
    assert (quantization, dtype, served_table) == ("w4a16", torch.float32, BUSY)
    assert formats.recorded_choice(formats_config(model_dir), "none", tmp_path / "host", lambda: host.key) == \
        formats.FormatChoice("w4a16", "cpu", host.key)


def test_a_cpu_without_one_serves_the_quiet_measurement_s_choice(model_dir, tmp_path):
    host = Host("scalar", [QUIET])
    assert start(model_dir, tmp_path, host)[0] == "int4"
    assert recorded(model_dir, tmp_path, host).basis == "measured"


def test_a_busy_measurement_without_one_serves_the_checkpoint_s_own_format(model_dir, tmp_path):
    host = Host("scalar", [BUSY])
    assert start(model_dir, tmp_path, host)[:2] == ("none", torch.float32)  # the float checkpoint: fp32
    assert recorded(model_dir, tmp_path, host) == formats.FormatChoice("fp32", "checkpoint", host.key)


@pytest.mark.parametrize("dot8", ["avx512_vnni", "avx2", "scalar"])
def test_a_busy_first_start_and_a_quiet_second_one_serve_the_same_format(model_dir, tmp_path, dot8, caplog):
    """The second start reads the record and decides nothing, and the model it loads has the same
    compiled-graph package keys as the first start's."""
    host = Host(dot8, [BUSY, QUIET])
    first = start(model_dir, tmp_path, host)[0]
    assert host.asked_cpu == 1
    with caplog.at_level(logging.INFO, logger="dualserve"):
        second = start(model_dir, tmp_path, host)[0]
    assert second == first == ("none" if dot8 == "scalar" else "w4a16")
    # The quiet table is measured for costs, not to decide. A table's record asks the CPU again
    # whether its path decides by itself now (``formats.W4A16_PATHS``); the CPU's record does not.
    assert host.asked_cpu == (2 if dot8 == "scalar" else 1) and host.measured == 2
    assert "this host's recorded choice" in caplog.text
    # The quiet table is cached now: a third start measures nothing at all.
    assert start(model_dir, tmp_path, host)[0] == first and host.measured == 2
    assert package_key(model_dir, tmp_path, first) == package_key(model_dir, tmp_path, second)
    # What the second start would have served had it decided again (int4 on this quiet table) is
    # another model, and every graph would be built again.
    assert package_key(model_dir, tmp_path, "int4") != package_key(model_dir, tmp_path, first)


def test_a_changed_host_key_decides_again_and_says_what_changed(model_dir, tmp_path, caplog):
    host = Host("scalar", [BUSY])
    assert start(model_dir, tmp_path, host)[0] == "none"
    host.key, host.dot8, host.tables = "avx512-amx0-bf160-t2-torchX-kernelsB", "avx512_vnni", [QUIET]
    with caplog.at_level(logging.INFO, logger="dualserve"):
        assert start(model_dir, tmp_path, host)[0] == "w4a16"
    assert "weight format changed from fp32 to w4a16" in caplog.text and "kernelsA -> kernelsB" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dualserve"):
        assert start(model_dir, tmp_path, host)[0] == "w4a16"
    assert "changed" not in caplog.text and "recorded choice" in caplog.text


def test_a_table_s_record_on_a_cpu_that_now_decides_is_decided_again_once(model_dir, tmp_path, caplog):
    """An AVX2 host recorded the checkpoint's format from a busy table before AVX2's path decided
    by the CPU: its next start serves w4a16 under the same host key, says why, and records it."""
    host = Host("scalar", [BUSY])
    assert start(model_dir, tmp_path, host)[0] == "none"
    host.dot8, host.tables = "avx2", [QUIET]  # the same key: only the rule differs
    with caplog.at_level(logging.INFO, logger="dualserve"):
        assert start(model_dir, tmp_path, host)[0] == "w4a16"
    assert "weight format changed from fp32 to w4a16" in caplog.text
    assert "dot8 path (avx2) now decides it" in caplog.text
    assert recorded(model_dir, tmp_path, host) == formats.FormatChoice("w4a16", "cpu", host.key)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dualserve"):
        assert start(model_dir, tmp_path, host)[0] == "w4a16"
    assert "changed" not in caplog.text and "recorded choice" in caplog.text


def test_an_explicit_quantization_is_served_and_its_difference_logged(model_dir, tmp_path, caplog):
    host = Host("avx512_vnni", [QUIET])
    assert start(model_dir, tmp_path, host)[0] == "w4a16"
    with caplog.at_level(logging.INFO, logger="dualserve"):
        assert start(model_dir, tmp_path, host, "--quantization", "int4")[0] == "int4"
    assert "weight format int4 (--quantization int4), not this host's recorded auto choice w4a16" in caplog.text
    assert recorded(model_dir, tmp_path, host).candidate == "w4a16"  # the record stays


def test_a_start_beside_another_that_decided_first_serves_its_format(model_dir, tmp_path):
    """Two first starts at once: the one that records second adopts the first one's decision."""
    import json

    host = Host("scalar", [QUIET])
    probe = host.probe()
    book = tmp_path / "host" / formats.CHOICES_FILE

    def other_start_decides() -> str:  # while this start decides, another records fp32 (it was busy)
        book.parent.mkdir(parents=True, exist_ok=True)
        book.write_text(json.dumps({f"{formats.shape_key(formats_config(model_dir))}|none":
                                    {"candidate": "fp32", "basis": "checkpoint", "host": host.key}}))
        return "scalar"

    probe = HostProbe(dot8_path=other_start_decides, measure=probe.measure, key=probe.key)
    spec = model_settings(["--model", str(model_dir), "--device", "cpu", "--cache-dir", str(tmp_path)]).model
    assert pick_format(spec, model_dir, tmp_path, torch.float32, probe)[0] == "none"  # fp32, not the quiet int4
    assert recorded(model_dir, tmp_path, host).basis == "checkpoint"


def test_an_unreadable_record_is_decided_again(model_dir, tmp_path):
    (tmp_path / "host").mkdir()
    (tmp_path / "host" / formats.CHOICES_FILE).write_text("{not json")
    host = Host("avx512_vnni", [QUIET])
    assert start(model_dir, tmp_path, host)[0] == "w4a16"
    assert recorded(model_dir, tmp_path, host).basis == "cpu"


def test_a_start_with_real_probes_keeps_its_first_decision(model_dir, tmp_path, caplog):
    """The real CPU, timing and host key: whatever the load on this machine, the second start
    serves the first one's format from the record."""
    spec = model_settings(["--model", str(model_dir), "--device", "cpu", "--cache-dir", str(tmp_path)]).model
    first = cli.pick_format(spec, model_dir, tmp_path, torch.float32)[0]
    with caplog.at_level(logging.INFO, logger="dualserve"):
        assert cli.pick_format(spec, model_dir, tmp_path, torch.float32)[0] == first
    assert "this host's recorded choice" in caplog.text


def formats_config(model_dir: Path):
    import json

    from dualserve.models.families import read_config

    return read_config(json.loads((model_dir / "config.json").read_text()))


def recorded(model_dir: Path, cache: Path, host: Host) -> formats.FormatChoice:
    choice = formats.recorded_choice(formats_config(model_dir), "none", cache / "host", lambda: host.key)
    assert choice is not None
    return choice


def package_key(model_dir: Path, cache: Path, quantization: str) -> str:
    """The part of a step package's key (``aoti.package_key``, as ``compiled`` computes it) that
    the loaded model decides: its tensors, module settings and the code it is traced from."""
    model = load_model(model_dir, name="tiny", dtype=torch.float32, device="cpu", cache_dir=cache,
                       quantization=quantization).model
    return aoti.package_key(model, aoti.traced_sources(model))


@pytest.mark.slow  # two starts of the real model: about a minute each on a busy 2-core host
def test_two_real_starts_serve_the_same_format_and_answer(default_gguf, cache_dir, tmp_path):
    """``dualserve serve`` twice on the default model with a fresh host cache (the model's
    conversion shared): the second start serves the first one's format from the record, and the
    same greedy answer."""
    from server_fixture import free_port, log_tail, sdk_client, stop, wait_healthy

    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "converted").symlink_to(cache_dir / "converted", target_is_directory=True)
    answers, logs = [], []
    for n in range(2):
        port, log = free_port(), tmp_path / f"start{n}.log"
        cmd = [sys.executable, "-m", "dualserve.server.cli", "serve", "--port", str(port), "--model",
               str(default_gguf), "--cache-dir", str(cache), "--no-compile", "--eagle", "none", "--twin", "none",
               "--log-level", "info"]
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_healthy(f"http://127.0.0.1:{port}", proc, log)
            client = sdk_client(f"http://127.0.0.1:{port}")
            answers.append(client.completions.create(model=client.models.list().data[0].id, prompt="The capital of",
                                                     max_tokens=8, temperature=0).choices[0].text)
        finally:
            stop(proc)
        logs.append(log.read_text(errors="replace"))
    chosen = [re.search(r"weight format (\S+)[,:]", text) for text in logs]
    assert all(chosen), log_tail(tmp_path / "start1.log")
    assert chosen[0][1] == chosen[1][1] and "this host's recorded choice" in logs[1]
    assert answers[0] == answers[1]
