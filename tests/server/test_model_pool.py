"""The loaded-models policy (``server/model_pool.py``): least recently used idle models unload first,
a busy one never, within a count and a memory budget; plain Python. Then the manager over it
(``server/model_manager.py``) with stand-in loads: one load shared by concurrent requests, its
failure too, and a busy model waited for."""

from __future__ import annotations

import pytest

from dualserve.server.model_pool import ModelPool, ModelState


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def pool_of(names, loaded, clock, **bounds) -> ModelPool:
    pool = ModelPool(names, clock=clock, **bounds)
    for i, name in enumerate(loaded):
        pool[name].state = ModelState.LOADED
        pool[name].last_used = i  # loaded in this order: the first is the least recently used
    return pool


def test_the_least_recently_used_idle_model_makes_room():
    clock = Clock()
    pool = pool_of(["a", "b", "c"], ["a", "b"], clock, max_loaded=2)
    assert pool.victims("c") == ["a"]
    pool.lease("a")  # used just now: b is the older one
    assert pool.victims("c") == ["b"]


def test_no_bound_unloads_nothing_and_a_loaded_model_needs_no_room():
    clock = Clock()
    assert pool_of(["a", "b", "c"], ["a", "b"], clock).victims("c") == []
    assert pool_of(["a", "b"], ["a", "b"], clock, max_loaded=2).victims("b") == []


def test_a_model_with_requests_in_flight_is_never_a_victim():
    clock = Clock()
    pool = pool_of(["a", "b", "c"], ["a", "b"], clock, max_loaded=2)
    pool.lease("a")
    pool.begin("a")  # the lease became a request in flight
    assert pool.victims("c") == ["b"]
    pool.begin("b")
    assert pool.victims("c") is None  # wait: only busy models could make room
    pool.end("b")
    assert pool.victims("c") == ["b"]


def test_a_lease_holds_its_model_until_it_expires():
    clock = Clock()
    pool = ModelPool(["a", "b"], max_loaded=1, lease_seconds=10.0, clock=clock)
    pool["a"].state = ModelState.LOADED
    pool.lease("a")  # handed to a request that has not started yet
    assert pool.victims("b") is None
    clock.now += 11  # that request never started (a 4xx while planning)
    assert pool.victims("b") == ["a"]


def test_the_memory_budget_unloads_until_the_newcomer_fits():
    clock = Clock()
    pool = pool_of(["a", "b", "c"], ["a", "b"], clock, memory_bytes=100)
    pool["a"].cost, pool["b"].cost, pool["c"].cost = 40, 40, 50
    assert pool.victims("c") == ["a"]
    pool["c"].cost = 90
    assert pool.victims("c") == ["a", "b"]
    pool.begin("b")
    assert pool.victims("c") is None  # b holds memory the newcomer needs: wait for it


def test_a_model_larger_than_the_budget_is_still_served_alone():
    clock = Clock()
    pool = pool_of(["a", "b"], ["a"], clock, memory_bytes=100)
    pool["a"].cost, pool["b"].cost = 30, 500
    assert pool.victims("b") == ["a"]


def test_over_budget_after_a_load_measures_its_cost():
    clock = Clock()
    pool = pool_of(["a", "b", "c"], ["a", "b", "c"], clock, memory_bytes=100)
    pool["a"].cost, pool["b"].cost, pool["c"].cost = 40, 40, 60  # c just loaded: now measured
    assert pool.over_budget(keep="c") == ["a"]
    pool.begin("a")
    assert pool.over_budget(keep="c") == ["b"]  # a is busy: b goes, and the rest waits for a check later
    assert ModelPool(["a"], clock=clock).over_budget(keep="a") == []


def test_bounds_are_checked():
    with pytest.raises(ValueError):
        ModelPool(["a"], max_loaded=0)


# ---- the manager over the policy: loads shared, failures shared, busy models waited for ------------


def manager_of(names, loads, fail=(), **bounds):
    """A ModelManager whose 'loads' record the name and take a moment (fake deployments)."""
    import threading
    import time

    from dualserve.server.model_manager import Loaded, ModelManager
    from dualserve.server.service import ServedModel

    unloaded, lock = [], threading.Lock()

    def load(name):
        time.sleep(0.05)  # long enough for concurrent requests to find it loading
        with lock:
            loads.append(name)
        if name in fail:
            raise RuntimeError(f"{name}.gguf:\n  truncated")
        return Loaded(deployment=name, served={name: ServedModel(name, None, 16, ["ar"])}, cost=10)

    manager = ModelManager(ModelPool(names, **bounds), load, unloaded.append, wait_seconds=1.0)
    return manager, unloaded


def in_threads(fn, n):
    import threading

    results = [None] * n

    def run(i):
        try:
            results[i] = fn()
        except Exception as e:  # noqa: BLE001 - the test reads it
            results[i] = e
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_concurrent_requests_share_one_load_and_its_failure():
    from dualserve.server.errors import APIError

    loads: list[str] = []
    manager, _ = manager_of(["a", "bad"], loads, fail=("bad",))
    got = in_threads(lambda: manager.acquire("a"), 4)
    assert loads == ["a"] and {m.name for m in got} == {"a"}
    assert manager.pool["a"].state is ModelState.LOADED and len(manager.pool["a"].leases) == 4
    failed = in_threads(lambda: manager.acquire("bad"), 3)
    assert loads.count("bad") == 1 and all(isinstance(e, APIError) and e.status == 503 for e in failed)
    assert failed[0].code == "model_load_failed" and "bad.gguf: truncated" in failed[0].message  # one line
    assert manager.pool["bad"].state is ModelState.UNLOADED and manager.pool["bad"].error
    with pytest.raises(KeyError):
        manager.acquire("nope")


def test_a_busy_model_is_waited_for_then_unloaded():
    import threading

    from dualserve.server.errors import APIError

    loads: list[str] = []
    manager, unloaded = manager_of(["a", "b"], loads, max_loaded=1)
    manager.acquire("a")
    manager.begin("a")  # a request runs on a
    with pytest.raises(APIError) as seen:  # it never ends within the wait: 429
        manager.acquire("b")
    assert seen.value.status == 429 and unloaded == []
    threading.Timer(0.2, manager.end, args=("a",)).start()
    assert manager.acquire("b").name == "b"  # waited for a's request to end
    assert unloaded == ["a"] and list(manager.loaded) == ["b"]
    assert [name for name, state, _, _ in manager.states() if state is ModelState.LOADED] == ["b"]


def test_the_memory_budget_is_checked_with_the_cost_a_load_measures():
    loads: list[str] = []
    manager, unloaded = manager_of(["a", "b", "c"], loads, memory_bytes=25)  # each fake model measures 10
    for name in ("a", "b"):
        manager.acquire(name)
        manager.begin(name)
        manager.end(name)
    assert unloaded == []  # 20 of 25
    manager.acquire("c")  # never loaded: its cost is known once loaded, and a (least recent) goes then
    assert unloaded == ["a"] and sorted(manager.loaded) == ["b", "c"]
    manager.begin("c")
    manager.end("c")
    manager.acquire("a")  # its cost is known now: b makes room before it loads
    assert unloaded == ["a", "b"] and sorted(manager.loaded) == ["a", "c"]
