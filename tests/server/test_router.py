"""The routing decision table: hints + what is loaded -> decoder and reason."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from dualserve.server.cli import decoder_traits
from dualserve.server.errors import APIError
from dualserve.server.router import DecoderTraits, RequestTraits, Route, Router, RoutingPolicy, load_policy

ALL = ["ar", "eagle", "diffusion"]
# What a model serving every decoder declares: its diffusion decoder fills between prefix and suffix.
NATIVE = {"diffusion": DecoderTraits(infill="native")}


def route(available: list[str], hint: str | None, router: Router | None = None,
          traits: dict[str, DecoderTraits] | None = None, **kw) -> Route:
    """Route a request with ``hint`` and the traits ``kw`` over ``available`` (diffusion infills natively
    unless ``traits`` says otherwise)."""
    return (router or Router()).route("m", available, RequestTraits(decoder=hint, **kw),
                                      NATIVE if traits is None else traits)


@pytest.mark.parametrize("available, hint, kw, expected", [
    # explicit hints are honoured
    (ALL, "ar", {}, "ar"),
    (ALL, "eagle", {}, "eagle"),
    (ALL, "diffusion", {}, "diffusion"),
    # auto: the seed's rule
    (ALL, "auto", {"priority": "interactive"}, "diffusion"),
    (ALL, "auto", {"latency_budget_ms": 200}, "diffusion"),
    (ALL, "auto", {"latency_budget_ms": 200, "priority": "high_value"}, "eagle"),
    (ALL, "auto", {"priority": "high_value"}, "eagle"),
    (ALL, "auto", {}, "eagle"),
    (ALL, "auto", {"priority": "batch"}, "ar"),
    (ALL, "auto", {"n": 4}, "ar"),
    (ALL, "auto", {"n": 4, "priority": "interactive"}, "ar"),
    (ALL, "auto", {"infill": True}, "diffusion"),
    (ALL, "auto", {"infill": True, "priority": "high_value"}, "diffusion"),
    (ALL, "auto", {"structured": True, "priority": "interactive"}, "diffusion"),
    (ALL, "auto", {"structured": True}, "ar"),
    (ALL, "auto", {"structured": True, "priority": "high_value"}, "ar"),
    (ALL, None, {"priority": "interactive"}, "diffusion"),
    # an agent turn: lossless speculation drafts what it copies, latency-bound or not
    (ALL, "auto", {"agent": True}, "eagle"),
    (ALL, "auto", {"agent": True, "priority": "interactive"}, "eagle"),
    (ALL, "auto", {"agent": True, "n": 3}, "ar"),
    (ALL, "auto", {"agent": True, "structured": True}, "ar"),
    (["ar", "diffusion"], "auto", {"agent": True, "priority": "interactive"}, "diffusion"),
    (ALL, "ar", {"agent": True}, "ar"),
    # what is loaded limits the choice
    (["ar"], "auto", {"priority": "interactive"}, "ar"),
    (["ar", "eagle"], "auto", {"priority": "interactive"}, "eagle"),
    (["ar"], "auto", {"infill": True}, "ar"),
    (["diffusion"], "auto", {"priority": "batch"}, "diffusion"),
    (["diffusion"], "auto", {"structured": True}, "diffusion"),
])
def test_decision_table(available, hint, kw, expected):
    decided = route(available, hint, **kw)
    assert decided.decoder == expected
    assert decided.reason


def test_an_infill_routed_by_auto_says_it_is_infill():
    assert route(ALL, "auto", infill=True).reason.startswith("infill:")
    # No decoder fills natively (or none is loaded): the lossless pick fills with FIM tokens, and says so.
    for available, traits in ((ALL, {}), (["ar"], NATIVE), (["ar", "eagle"], {})):
        decided = route(available, "auto", traits=traits, infill=True)
        assert decided.reason.startswith("infill with FIM tokens; "), decided.reason
    assert "infill" not in route(ALL, "auto").reason
    assert route(ALL, "ar", traits={}, infill=True).reason == "requested"


@pytest.mark.parametrize("available, hint, kw, param", [
    (ALL, "fast", {}, "decoder"),
    (["ar"], "eagle", {}, "decoder"),
    (["ar"], "diffusion", {}, "decoder"),
    (ALL, "auto", {"priority": "urgent"}, "priority"),
])
def test_refusals_are_400s_that_say_why(available, hint, kw, param):
    with pytest.raises(APIError) as err:
        route(available, hint, **kw)
    assert err.value.status == 400 and err.value.param == param
    assert "ar" in err.value.message or "interactive" in err.value.message


def test_policy_file(tmp_path):
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"interactive": "eagle", "latency_budget_ms": 50}))
    policy = load_policy(path)
    assert policy == RoutingPolicy(interactive="eagle", latency_budget_ms=50)
    router = Router(policy)
    assert route(ALL, "auto", router, priority="interactive").decoder == "eagle"
    assert route(ALL, "auto", router, latency_budget_ms=200).decoder == "eagle"  # above the 50 ms bar
    path.write_text(json.dumps({"bogus": 1}))
    with pytest.raises(ValueError):
        load_policy(path)


@pytest.mark.slow
def test_calibration_routes_by_measured_speed(default_gguf, cache_dir):
    from dualserve.decoders.deployment import PoolSpec, ServedSpec, build_deployment
    from dualserve.models.assets import default_eagle_head, default_twin
    from dualserve.models.loader import load_model
    from dualserve.server.calibrate import calibrate

    base = load_model(default_gguf, cache_dir=cache_dir)
    twin = load_model(default_twin(base.name), name=base.name, cache_dir=cache_dir)
    spec = ServedSpec(base.name, base, eagle_head=default_eagle_head(base.name), twin=twin)
    dep = build_deployment([spec], pool=PoolSpec(num_blocks=64))
    policy, speeds = calibrate(dep.engine, base.name, base.tokenizer, RoutingPolicy(), max_tokens=8)
    assert set(speeds) == {"ar", "eagle", "diffusion"} and all(s > 0 for s in speeds.values())
    assert policy.interactive == max(speeds, key=speeds.get)
    assert policy.high_value == max(("ar", "eagle"), key=speeds.get)
    assert policy.batch == "ar"
    assert dep.engine.pool.num_used_blocks == 0, "calibration frees what it used"


class FimTokenizer:
    """A tokenizer with StarCoder's fill-in-the-middle tokens: one id per character, specials whole."""

    SPECIAL = {"<fim_prefix>": 1000, "<fim_suffix>": 1001, "<fim_middle>": 1002}

    def token_to_id(self, token: str) -> int | None:
        return self.SPECIAL.get(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = []
        while text:
            special = next((s for s in self.SPECIAL if text.startswith(s)), None)
            ids.append(self.SPECIAL[special] if special else ord(text[0]))
            text = text[len(special or text[0]):]
        return ids

    def decode(self, ids: list[int]) -> str:
        names = {v: k for k, v in self.SPECIAL.items()}
        return "".join(names.get(i) or chr(i) for i in ids)


def test_route_carries_the_decoders_traits():
    traits = {"diffusion": DecoderTraits(infill="native", default_max_tokens=256)}
    diffusion = route(ALL, "diffusion", traits=traits)
    assert diffusion.traits == traits["diffusion"] and diffusion.default_max_tokens(None) == 256
    assert diffusion.default_max_tokens(16) == 16  # an endpoint's own default wins
    ar = route(ALL, "ar", traits=traits)
    assert ar.traits == DecoderTraits() and ar.default_max_tokens(None) is None


def test_traits_come_from_what_each_decoder_declares():
    def decoder(name: str, supports_infill: bool, default_max_tokens: int | None):
        return SimpleNamespace(name=name, supports_infill=supports_infill, default_max_tokens=default_max_tokens,
                               draft_choices=("auto", "head", "suffix", "both") if name == "eagle" else ())

    assert decoder_traits(decoder("ar", False, None)) == DecoderTraits(infill="fim")  # AR infills with FIM tokens
    assert decoder_traits(decoder("eagle", False, None)) == DecoderTraits(infill="fim",
                                                                        drafts=("auto", "head", "suffix", "both"))
    assert decoder_traits(decoder("diffusion", True, 256)) == DecoderTraits(infill="native", default_max_tokens=256)
    assert decoder_traits(decoder("diffusion", False, 128)) == DecoderTraits(infill="none", default_max_tokens=128)


def test_route_places_a_suffix_as_its_decoder_infills():
    tok = FimTokenizer()
    prompts = [tok.encode("def f(")]
    native = Route("diffusion", "requested", DecoderTraits(infill="native"))
    assert native.with_suffix(tok, prompts, "):") == (prompts, tok.encode("):"))
    rewritten, suffix_ids = Route("ar", "requested").with_suffix(tok, prompts, "):")
    assert tok.decode(rewritten[0]) == "<fim_prefix>def f(<fim_suffix>):<fim_middle>" and suffix_ids == []
    assert native.infill(tok, "a", "b", []).suffix_ids == tok.encode("b")
    assert Route("ar", "requested").infill(tok, "a", "b", []).suffix_ids == []



def test_policy_fitted_to_forward_costs() -> None:
    """Start-up format measurements decide whether speculation pays on this host."""
    from dualserve.models.formats import FormatTable
    from dualserve.server.calibrate import fit_to_forward_costs
    from dualserve.server.router import RoutingPolicy

    def table(one: float, eight: float) -> FormatTable:
        return FormatTable("test", {"int4": {"1": one, "8": eight}})

    # 8 tokens cost 2.6x one (a small CPU): whole trees and the twin's blocks do not pay, but EAGLE's
    # budget drafts only what pays (suffix lookup is free) and else takes plain steps: EAGLE, not
    # the twin, whichever order the decoders come in
    slow = fit_to_forward_costs(RoutingPolicy(), table(7.0, 18.3), "int4", ALL)
    assert (slow.interactive, slow.high_value) == ("eagle", "eagle")
    slow = fit_to_forward_costs(RoutingPolicy(), table(7.0, 18.3), "int4", ["ar", "diffusion", "eagle"])
    assert (slow.interactive, slow.high_value) == ("eagle", "eagle")
    no_eagle = fit_to_forward_costs(RoutingPolicy(), table(7.0, 18.3), "int4", ["ar", "diffusion"])
    assert (no_eagle.interactive, no_eagle.high_value) == ("ar", "ar")
    # multi-token forwards cost about one (AMX, GPUs): speculation pays, lossless EAGLE for high value
    flat = fit_to_forward_costs(RoutingPolicy(), table(7.0, 7.4), "int4", ALL)
    assert (flat.interactive, flat.high_value) == ("eagle", "eagle")
    assert fit_to_forward_costs(RoutingPolicy(), table(7.0, 7.4), "int4", ["ar", "diffusion"]).interactive == \
        "diffusion"


def test_a_draft_model_that_is_not_loaded_is_a_400():
    """``draft: "block"`` on a model whose eagle decoder has no DFlash drafter is refused with the
    choices it has; a loaded source routes, and the field means nothing to another decoder."""
    from dualserve.server.errors import ErrorKind
    from dualserve.server.protocol import CompletionRequest
    from dualserve.server.service import ServedModel, Service

    traits = {"eagle": DecoderTraits(drafts=("auto", "head", "suffix", "both")), "ar": DecoderTraits()}
    model = ServedModel("m", SimpleNamespace(backend=SimpleNamespace(get_vocab=lambda: {"a": 0})), 64,
                        ["ar", "eagle"], traits)
    service = Service(None, {"m": model}, Router())
    body = CompletionRequest(model="m", prompt="hi", draft="block")
    with pytest.raises(APIError) as err:
        service.route(model, RequestTraits.of(body, "eagle"))
    assert err.value.kind == ErrorKind.INVALID_REQUEST and err.value.param == "draft"
    assert "head, suffix" in err.value.message
    head = CompletionRequest(model="m", prompt="hi", draft="head")
    assert service.route(model, RequestTraits.of(head, "eagle")).decoder == "eagle"
    assert service.route(model, RequestTraits.of(body, "ar")).decoder == "ar"


def test_request_traits_carry_the_bodys_hints():
    from dualserve.server.protocol import CompletionRequest

    body = CompletionRequest(model="m", prompt="hi", priority="batch", latency_budget_ms=50, n=2, draft="suffix")
    assert RequestTraits.of(body, "auto", infill=True) == RequestTraits("auto", "batch", 50, 2, "suffix", infill=True)


def test_infill_goes_to_diffusion_only_where_it_fills_natively():
    assert route(ALL, "auto", infill=True).decoder == "diffusion"
    block_causal = {"diffusion": DecoderTraits(infill="none")}  # never sees the suffix: FIM on eagle
    decided = route(ALL, "auto", traits=block_causal, infill=True)
    assert decided.decoder == "eagle" and decided.reason.startswith("infill with FIM tokens; ")
