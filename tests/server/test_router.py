"""The routing decision table: hints + what is loaded -> decoder and reason."""

from __future__ import annotations

import json

import pytest

from dualserve.server.errors import APIError
from dualserve.server.router import Router, RoutingPolicy, load_policy

ALL = ["ar", "eagle", "diffusion"]


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
    # what is loaded limits the choice
    (["ar"], "auto", {"priority": "interactive"}, "ar"),
    (["ar", "eagle"], "auto", {"priority": "interactive"}, "eagle"),
    (["ar"], "auto", {"infill": True}, "ar"),
    (["diffusion"], "auto", {"priority": "batch"}, "diffusion"),
    (["diffusion"], "auto", {"structured": True}, "diffusion"),
])
def test_decision_table(available, hint, kw, expected):
    route = Router().route("m", available, hint, **kw)
    assert route.decoder == expected
    assert route.reason


@pytest.mark.parametrize("available, hint, kw, param", [
    (ALL, "fast", {}, "decoder"),
    (["ar"], "eagle", {}, "decoder"),
    (["ar"], "diffusion", {}, "decoder"),
    (ALL, "auto", {"priority": "urgent"}, "priority"),
])
def test_refusals_are_400s_that_say_why(available, hint, kw, param):
    with pytest.raises(APIError) as err:
        Router().route("m", available, hint, **kw)
    assert err.value.status == 400 and err.value.param == param
    assert "ar" in err.value.message or "interactive" in err.value.message


def test_policy_file(tmp_path):
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"interactive": "eagle", "latency_budget_ms": 50}))
    policy = load_policy(path)
    assert policy == RoutingPolicy(interactive="eagle", latency_budget_ms=50)
    router = Router(policy)
    assert router.route("m", ALL, "auto", priority="interactive").decoder == "eagle"
    assert router.route("m", ALL, "auto", latency_budget_ms=200).decoder == "eagle"  # above the 50 ms bar
    path.write_text(json.dumps({"bogus": 1}))
    with pytest.raises(ValueError):
        load_policy(path)
