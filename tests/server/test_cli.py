"""The ``dualserve`` command: the settings it builds from its flags, and what each subcommand loads."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from dualserve.decoders.deployment import PoolSpec
from dualserve.server import cli
from dualserve.server.cli import model_settings
from dualserve.server.settings import GenerateSettings, ParallelSpec
from tiny_twin import write_tiny_llama


class Loaded(Exception):
    """Raised by the stand-in loader: the test only wants the arguments it was given."""


@pytest.fixture
def loads(monkeypatch):
    """The settings ``load_deployment`` would receive for a command line."""
    def capture(settings, *_):
        raise Loaded(settings)

    monkeypatch.setattr(cli, "load_deployment", capture)

    def run(*argv: str):
        with pytest.raises(Loaded) as seen:
            cli.main(list(argv))
        return seen.value.args[0]
    return run


@pytest.mark.parametrize("decoder, twin, eagle", [
    ("ar", "none", "none"),          # plain AR: neither the twin nor the EAGLE head
    ("eagle", "none", "auto"),       # EAGLE: its head only
    ("diffusion", "auto", "none"),   # diffusion: the twin only
])
def test_generate_loads_only_what_its_decoder_uses(loads, decoder, twin, eagle):
    model = loads("generate", "hi", "--decoder", decoder, "--diffusion", "some-llada").model
    assert (model.twin, model.eagle, model.diffusion) == (twin, eagle, None)


def test_generate_keeps_an_explicit_twin_for_diffusion(loads, tmp_path):
    model = loads("generate", "hi", "--decoder", "diffusion", "--twin", str(tmp_path)).model
    assert model.twin == str(tmp_path) and model.eagle == "none"


def test_serve_loads_everything_as_before(loads, monkeypatch):
    monkeypatch.setattr("dualserve.server.lifecycle.bind_port", lambda host, port: None)
    model = loads("serve", "--port", "0", "--diffusion", "some-llada").model
    assert (model.twin, model.eagle, model.diffusion, model.datastore) == ("auto", "auto", "some-llada", "auto")


def test_settings_are_frozen_and_built_once_from_the_flags(loads, tmp_path):
    settings = loads("generate", "hi", "--device", "cpu", "--cache-dir", str(tmp_path), "--num-blocks", "64",
                     "--max-num-seqs", "3", "--max-queue-wait", "0", "--no-compile", "--tp-timeout", "9",
                     "--max-tokens", "5", "--chat")
    assert settings.model.cache_dir == tmp_path and settings.model.device == "cpu"
    assert settings.pool == PoolSpec(block_size=16, num_blocks=64, memory_gb=settings.pool.memory_gb)
    assert settings.engine.max_num_seqs == 3 and settings.engine.max_queue_wait is None
    assert settings.compile is None and settings.parallel.timeout == 9 and settings.server is None
    assert settings.generate == GenerateSettings(prompt="hi", max_tokens=5, chat=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.model.device = "cuda"


def test_serve_settings_and_the_environment_s_documented_knobs(loads, monkeypatch, tmp_path):
    monkeypatch.setattr("dualserve.server.lifecycle.bind_port", lambda host, port: None)
    monkeypatch.setenv("DUALSERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("DUALSERVE_ATTEND_KERNEL", "0")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    settings = loads("serve", "--port", "0", "--api-key", "k", "--device", "cpu")
    assert settings.server.api_key == "k" and settings.server.port == 0 and settings.generate is None
    assert settings.model.cache_dir == tmp_path and settings.compile.cache_dir == tmp_path / "compile"
    assert settings.compile.background and not settings.compile.attend_kernel
    assert settings.parallel.launched is None
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    assert ParallelSpec.from_env(env, size=2) == ParallelSpec(size=2, launched=(1, 2), local_rank=1)


def test_settings_travel_to_another_process(tmp_path):
    """Spawned tensor-parallel ranks receive rank 0's settings; the compile worker is each process's own."""
    settings = model_settings(["--device", "cpu", "--cache-dir", str(tmp_path)], command="serve")
    copy = pickle.loads(pickle.dumps(settings))
    assert copy == settings and copy.compile.worker is not settings.compile.worker


@pytest.mark.parametrize("flag, value, says", [
    ("--tensor-parallel-size", "0", "must be at least 1"),
    ("--threads", "0", "must be at least 1"),
    ("--num-blocks", "-4", "must be at least 1"),
    ("--max-model-len", "x", "must be a whole number"),
    ("--port", "99999", "0 to 65535"),
    ("--max-queue-wait", "-1", "must be at least 0 and finite"),
    ("--request-timeout", "0", "must be above 0 and finite"),
    ("--max-body-mb", "inf", "must be above 0 and finite"),
    ("--tp-timeout", "soon", "must be a number"),
])
def test_a_flag_out_of_its_range_is_one_line_before_anything_loads(loads, capsys, flag, value, says):
    with pytest.raises(SystemExit) as done:
        cli.main(["serve", flag, value])
    assert done.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("dualserve serve: error: argument " + flag) and says in err


def test_a_host_that_does_not_resolve_is_one_line(capsys, tmp_path):
    assert cli.main(["serve", "--host", "300.1.1.1", "--cache-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dualserve: cannot listen on 300.1.1.1:8000")


def test_a_datastore_that_cannot_serve_is_one_line(tmp_path, capsys):
    """Not a datastore at all, or another model's answers (ids past this model's vocabulary)."""
    from dualserve.decoders.eagle.datastore import Datastore

    model = write_tiny_llama(tmp_path)
    bad = tmp_path / "answers.npz"
    bad.write_text("not numbers")
    other = tmp_path / "other.npz"
    Datastore.from_answers([[1, 2, 3], [60000, 5]]).save(other)
    capsys.readouterr()
    for path, says in ((bad, "not a datastore"), (other, "holds token id 60000, past")):
        assert cli.main(["generate", "--model", str(model), "--quantization", "none", "--decoder", "eagle", "--eagle",
                         "suffix", "--datastore", str(path), "--cache-dir", str(tmp_path / "cache"), "hi"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"dualserve: {path}: ") and says in err[0], err


def test_more_ranks_than_key_value_heads_are_refused_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    model = write_tiny_llama(tmp_path)  # 2 key/value heads
    capsys.readouterr()  # the writer's progress bars
    monkeypatch.setattr(cli, "load_deployment", lambda *_: pytest.fail("loaded"))
    assert cli.main(["generate", "--model", str(model), "--tensor-parallel-size", "3", "--quantization", "none",
                     "--cache-dir", str(tmp_path / "cache"), "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tensor-parallel-size 3 cannot split" in err[0], err
    assert "it has 2 key/value heads, so at most 2" in err[0]


def _rank_takes_format(rank: int, rendezvous: str, quantization: str, out) -> None:
    import torch.distributed as dist

    from dualserve.server.tensor_parallel import rank0_format

    settings = model_settings(["--device", "cpu", "--quantization", quantization], command="serve")
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=2)
    try:
        agreed = rank0_format(settings).model
        out.put((rank, agreed.quantization, agreed.dtype))
    finally:
        dist.destroy_process_group()


def test_a_torchrun_rank_takes_rank_0_s_weight_format(tmp_path):
    """Under torchrun every rank starts from the command line; a rank other than 0 loads the format
    rank 0 resolved (--quantization auto), never one it measured for itself."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    rendezvous = f"file://{tmp_path / 'rendezvous'}"
    procs = [ctx.Process(target=_rank_takes_format, args=(r, rendezvous, q, out))
             for r, q in ((0, "w4a16"), (1, "auto"))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    seen = sorted(out.get(timeout=5) for _ in procs)
    assert seen == [(0, "w4a16", "auto"), (1, "w4a16", "auto")]
