"""A seeded fuzz campaign over the three generation endpoints (issue 15), against the real server.

Bodies come from ``clients/fuzz.py`` (hypothesis strategies: valid values beside the ones that
once broke a decoder, wrong types, bodies that are not JSON objects). Every answer must be a
2xx or an OpenAI-shaped 4xx (or a deliberate 503 / 504), every stream must end with its end
marker and carry no server error, and no request may hang. A few hundred requests, seeded, so
a failure replays; generation stays at a few tokens, so the campaign takes well under a minute.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings

from dualserve.clients.fuzz import is_stream, request, verdict

HANG_S = 60.0  # a request that takes longer has hung
EXAMPLES = {"/v1/completions": 100, "/v1/chat/completions": 80, "/infill": 50}
STATUSES: dict[str, Counter] = defaultdict(Counter)  # by endpoint, filled as the campaign runs


@pytest.fixture(scope="module")
def http(server_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server_url, timeout=HANG_S) as c:
        yield c


def check(http: httpx.Client, endpoint: str, raw: bytes) -> None:
    try:
        r = http.post(endpoint, content=raw, headers={"Content-Type": "application/json"})
    except httpx.TimeoutException:
        pytest.fail(f"hung for {HANG_S:.0f} s: {endpoint} {raw[:300]!r}")
    STATUSES[endpoint][r.status_code] += 1
    problem = verdict(r.status_code, r.content, is_stream(raw), endpoint)
    assert problem is None, f"{endpoint} {raw[:500]!r} -> {problem}"


def campaign(endpoint: str):
    @seed(15)
    @settings(max_examples=EXAMPLES[endpoint], deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=[HealthCheck.too_slow])
    @given(item=request(endpoint))
    def run(http: httpx.Client, item: tuple[str, bytes]) -> None:
        check(http, *item)

    return run


test_completions_fuzz = campaign("/v1/completions")
test_chat_fuzz = campaign("/v1/chat/completions")
test_infill_fuzz = campaign("/infill")


def test_the_campaign_was_served_not_only_refused() -> None:
    """A campaign of nothing but 400s would prove little: about half the bodies are valid."""
    for endpoint, statuses in STATUSES.items():
        assert statuses[200] >= sum(statuses.values()) // 4, (endpoint, dict(statuses))
