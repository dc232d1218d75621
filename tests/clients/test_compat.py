"""The compatibility check (clients/compat.py) against dualserve: every request shape passes, as the
README's side-by-side table says."""

from __future__ import annotations

from dualserve.clients.compat import CHECKS, run


def test_every_compat_check_passes_on_dualserve(server_url):
    results = run(f"{server_url}/v1")
    assert len(results) == len(CHECKS)
    assert {name: r for name, r in results.items() if r != "pass"} == {}
