"""The ``dualserve`` command loads what each subcommand uses."""

from __future__ import annotations

import pytest

from dualserve.server import cli


class Loaded(Exception):
    """Raised by the stand-in loader: the test only wants the arguments it was given."""


@pytest.fixture
def loads(monkeypatch):
    """The arguments ``load_deployment`` would receive for a command line."""
    def capture(args):
        raise Loaded(args)

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
    args = loads("generate", "hi", "--decoder", decoder, "--diffusion", "some-llada")
    assert (args.twin, args.eagle, args.diffusion) == (twin, eagle, None)


def test_generate_keeps_an_explicit_twin_for_diffusion(loads, tmp_path):
    args = loads("generate", "hi", "--decoder", "diffusion", "--twin", str(tmp_path))
    assert args.twin == str(tmp_path) and args.eagle == "none"


def test_serve_loads_everything_as_before(loads, monkeypatch):
    monkeypatch.setattr("dualserve.server.lifecycle.bind_port", lambda host, port: None)
    args = loads("serve", "--port", "0", "--diffusion", "some-llada")
    assert (args.twin, args.eagle, args.diffusion) == ("auto", "auto", "some-llada")
