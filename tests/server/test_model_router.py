"""The router on an event loop, with fake engines: one load for many waiting requests,
unloads to make room, a bounded wait that ends in a 503 saying why, a failed load that
fails only its own requests, and keep-alive 0."""

import asyncio
import threading
from types import SimpleNamespace

import pytest

from mlxkv.errors import MlxkvError
from mlxkv.server.api_errors import ApiError
from mlxkv.server.model_names import ModelNames
from mlxkv.server.model_registry import LoadLimits, ModelRegistry
from mlxkv.server.model_router import ModelRouter
from mlxkv.server.model_specs import NEVER, ModelSpec
from server_support import wait_for as wait_until


class Engines:
    def __init__(self):
        self.started, self.stopped, self.tried = [], [], []

    def start(self, spec):
        self.tried.append(spec.name)
        if spec.source == "broken":
            raise MlxkvError(f"no model at {spec.source}")
        self.started.append(spec.name)
        return SimpleNamespace(name=spec.name, thread=SimpleNamespace(open_requests=0)), 10

    def stop(self, backend):
        self.stopped.append(backend.name)


def router(specs, engines, wait_s=5.0, max_waiting=8, **limits):
    reg = ModelRegistry(specs, LoadLimits(**limits))
    return ModelRouter(reg, ModelNames([s.name for s in specs], [("claude-*", specs[0].name)]), engines.start,
                       engines.stop, wait_s=wait_s, max_waiting=max_waiting, tick_s=0.02)


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 10))


A, B = ModelSpec("a", "a", keep_alive_s=NEVER), ModelSpec("b", "b", keep_alive_s=NEVER)


def test_many_requests_wait_for_one_load_and_an_alias_reaches_its_model():
    engines = Engines()
    r = router([A, B], engines)

    async def main():
        slots = await asyncio.gather(*(r.acquire(name) for name in ("a", "a", "claude-x")))
        assert {s.name for s in slots} == {"a"} and slots[0].leases == 3
        with pytest.raises(ApiError) as e:
            await r.acquire("gpt-4o")
        assert e.value.status == 404 and "'a', 'b'" in e.value.message

    run(main())
    assert engines.started == ["a"]


def test_max_loaded_one_unloads_the_idle_model_and_waits_for_a_busy_one():
    engines = Engines()
    r = router([A, B], engines, max_loaded=1)

    async def main():
        a = await r.acquire("a")
        waiting = asyncio.ensure_future(r.acquire("b"))
        await asyncio.sleep(0.1)
        assert not waiting.done() and engines.stopped == []  # a has an open request
        r.release(a)
        b = await waiting
        assert (b.name, a.state, a.unloads, engines.stopped) == ("b", "unloaded", 1, ["a"])

    run(main())


def test_a_request_that_cannot_get_room_gets_a_503_saying_why():
    engines = Engines()
    r = router([A, B], engines, wait_s=0.1, max_loaded=1)
    r0 = router([A, B], Engines(), max_waiting=0, max_loaded=1)

    async def main():
        await r.acquire("a")
        with pytest.raises(ApiError) as e:
            await r.acquire("b")
        assert e.value.status == 503 and "--max-loaded 1" in e.value.message and "a (1 open requests)" in e.value.message
        await r0.acquire("a")
        with pytest.raises(ApiError) as e:  # the queue is full: no wait at all
            await r0.acquire("b")
        assert e.value.status == 503 and "0 requests already wait" in e.value.message

    run(main())


def test_a_model_that_fails_to_load_fails_its_own_requests_and_the_others_serve():
    engines = Engines()
    r = router([ModelSpec("bad", "broken"), A], engines)

    async def main():
        for _ in range(2):  # the second is told at once, without a second load
            with pytest.raises(ApiError) as e:
                await r.acquire("bad")
            assert e.value.status == 500 and "no model at broken" in e.value.message
        assert (await r.acquire("a")).name == "a"

    run(main())
    assert engines.tried == ["bad", "a"]


def test_keep_alive_zero_unloads_when_the_last_request_ends():
    engines = Engines()
    r = router([ModelSpec("a", "a", keep_alive_s=0)], engines)

    async def main():
        slot = await r.acquire("a")
        await asyncio.sleep(0.05)
        assert slot.state == "loaded"
        r.release(slot)
        for _ in range(500):  # the unload runs on a worker thread: on a loaded machine it takes a while
            if slot.state == "unloaded":
                break
            await asyncio.sleep(0.01)
        assert slot.state == "unloaded" and engines.stopped == ["a"]

    run(main())


def test_a_model_loaded_for_a_waiting_request_is_not_reaped_before_the_request_leases_it():
    """Keep-alive 0: the reaper's tick may land between the load's end and the waiter's wake-up
    (it did under load: the model was loaded and unloaded three times for one request)."""
    engines = Engines()
    r = router([ModelSpec("a", "a", keep_alive_s=0)], engines)
    loaded_as = r.registry.loaded_as

    def loaded_then_a_tick(*args):
        loaded_as(*args)
        r.reap()  # the keep-alive's tick, before the waiting request runs

    r.registry.loaded_as = loaded_then_a_tick

    async def main():
        slot = await r.acquire("a")
        assert slot.state == "loaded" and engines.started == ["a"] and engines.stopped == []
        r.release(slot)

    run(main())


def test_a_load_cancelled_by_the_servers_stop_leaves_no_slot_loading_and_closes_what_it_loaded():
    """The server's loop cancels its tasks as it stops, a load's too: the slot is no longer
    "loading", and the engine the load still finishes is closed."""
    engines = Engines()
    gate = threading.Event()
    start = engines.start
    engines.start = lambda spec: gate.wait(10) and start(spec)
    r = router([A, B], engines)

    async def main():
        waiting = asyncio.ensure_future(r.acquire("a"))
        await asyncio.sleep(0.05)
        assert r.registry.slot("a").state == "loading"
        for task in list(r._tasks):  # what asyncio.run's shutdown does to tasks still running
            task.cancel()
        await asyncio.sleep(0.05)
        waiting.cancel()

    run(main())
    slot = r.registry.slot("a")
    assert slot.state == "failed" and "stopped" in slot.error
    gate.set()
    assert wait_until(lambda: engines.stopped == ["a"])
