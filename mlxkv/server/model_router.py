"""A request's model, on the event loop: named, aliased, loaded on demand within the limits.

The registry (model_registry.py) decides; this carries its decisions out.
Loads and unloads run on worker threads (a load takes seconds, an unload
waits for the SSD tier's writes), so the loop keeps answering /health,
/metrics and other models' streams meanwhile. Every state change wakes the
requests waiting for one. A request holds a lease on its model from the
moment it is routed until its response has been sent (model_leases in
http_app.py), so a model with an open stream is never unloaded.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from mlxkv.errors import MlxkvError
from mlxkv.server.api_errors import ApiError
from mlxkv.server.loading_stream import LoadPending
from mlxkv.server.model_names import ModelNames
from mlxkv.server.model_registry import FAILED, LOADED, UNLOADED, ModelRegistry, ModelSlot
from mlxkv.server.model_specs import ModelSpec

log = logging.getLogger(__name__)

MAX_WAITING = 64  # requests waiting for room to load their model; more get a 503 at once
WAIT_S = 60.0  # the longest a request waits for room (or for its model's load to start)
TICK_S = 1.0  # how often idle models are looked at, and waiting requests look again
RETRY_AFTER = {"Retry-After": "5"}


class ModelRouter:
    """`start(spec) -> (backend, footprint)` and `stop(backend)` block: they run on worker threads."""

    def __init__(self, registry: ModelRegistry, names: ModelNames, start: Callable[[ModelSpec], tuple],
                 stop: Callable[[object], None], *, max_waiting: int = MAX_WAITING, wait_s: float = WAIT_S,
                 tick_s: float = TICK_S):
        self.registry, self.names = registry, names
        self._start, self._stop = start, stop
        self.max_waiting, self.wait_s, self.tick_s = max_waiting, wait_s, tick_s
        self.waiting = 0
        self._changed: asyncio.Event | None = None  # replaced at each change: waiters hold the old one
        self._tasks: set[asyncio.Task] = set()

    # -- requests -------------------------------------------------------------

    async def acquire(self, requested: str) -> ModelSlot:
        """The slot of the model `requested` names, loaded and leased; an ApiError says why not."""
        name = self.names.resolve(requested)
        if name is None:
            raise ApiError(404, self.names.unknown(requested), param="model")
        slot = self.registry.slot(name)
        why = self.registry.never_fits(slot)
        if why is not None:
            raise ApiError(503, why)
        deadline = time.monotonic() + self.wait_s
        queued = False
        # Until it leases the model, this request holds it against the keep-alive and other loads'
        # unloads: a model loaded for it was unloaded again (keep-alive 0) before it woke to lease it.
        self.registry.wait_for(slot)
        try:
            while True:
                if slot.state == LOADED:
                    self.registry.lease(slot)
                    return slot
                if slot.state == FAILED and not self.registry.may_retry(slot):
                    raise ApiError(500, f"model {name!r} could not be loaded: {slot.error}")
                if slot.state in (UNLOADED, FAILED):
                    victims = self.registry.plan(slot)
                    if victims is not None:
                        self._begin_load(slot, victims)
                        continue
                    if not queued:
                        if self.waiting >= self.max_waiting:
                            raise ApiError(503, f"model {name!r} cannot load now and {self.waiting} requests "
                                                f"already wait: {self.registry.blocked_by()}", headers=RETRY_AFTER)
                        queued, self.waiting = True, self.waiting + 1
                if not await self._wait(deadline):
                    raise ApiError(503, f"model {name!r} could not be loaded within {self.wait_s:g} s: "
                                        f"{self.registry.blocked_by() if slot.state == UNLOADED else slot.state}",
                                   headers=RETRY_AFTER)
        finally:
            self.registry.stop_waiting(slot)
            if queued:
                self.waiting -= 1

    def is_loaded(self, requested: str) -> bool:
        """Whether `requested` names a loaded model; an unknown name counts as loaded (its 404 is at once)."""
        name = self.names.resolve(requested)
        return name is None or self.registry.slot(name).state == LOADED

    def release(self, slot: ModelSlot) -> None:
        """The request's response has been sent (or it failed): the model may go idle."""
        self.registry.release(slot)
        self.reap()
        self._notify()

    # -- loads and unloads --------------------------------------------------------

    def _begin_load(self, slot: ModelSlot, victims: list[ModelSlot]) -> None:
        """Mark the load and its unloads now, on the loop, so no other request sees a stale state."""
        for victim in victims:
            self.registry.unloading(victim)
        self.registry.loading(slot)
        self._spawn(self._load(slot, victims))

    async def _load(self, slot: ModelSlot, victims: list[ModelSlot]) -> None:
        for victim in victims:
            await self._unload(victim, "to make room for " + slot.name)
        log.info("model %s: load started", slot.name)
        begin = time.monotonic()
        work = self._in_thread(self._start, slot.spec)
        try:
            backend, footprint = await asyncio.wrap_future(work)
        except asyncio.CancelledError:
            # The server is stopping (its loop cancels this task). The load cannot be cut; it
            # runs on in its thread, and what it loads is closed once it has. The slot must not
            # stay "loading": nothing would ever move it on.
            log.info("model %s: the server stopped while it loaded", slot.name)
            self.registry.failed(slot, "the server stopped while it loaded")
            work.add_done_callback(self._stop_late)
            raise
        except Exception as e:  # its own requests get the reason; the others keep serving
            if not isinstance(e, MlxkvError):  # not a user's mistake: keep the traceback
                log.exception("model %s failed to load", slot.name)
            error = str(e) or type(e).__name__
            log.error("model %s: could not be loaded: %s", slot.name, error)
            self.registry.failed(slot, error)
        else:
            load_s = time.monotonic() - begin
            self.registry.loaded_as(slot, backend, footprint, load_s)
            log.info("model %s: loaded in %.1f s (%d MiB of weights and pool)", slot.name, load_s, footprint >> 20)
        self._notify()

    @staticmethod
    def _in_thread(fn, *args) -> Future:
        """`fn(*args)` on a thread of its own, whose Future outlives the event loop (to_thread's
        executor thread is joined at exit, and its result is lost once the loop is gone)."""
        future: Future = Future()
        future.set_running_or_notify_cancel()  # running: the loop's cancel cannot cancel it (wrap_future tries)

        def run() -> None:
            try:
                future.set_result(fn(*args))
            except BaseException as e:
                future.set_exception(e)

        threading.Thread(target=run, name="mlxkv-model-load", daemon=True).start()
        return future

    def _stop_late(self, work: Future) -> None:
        """A load the server's stop cut short has finished: close what it loaded (on its thread)."""
        if work.exception() is None:
            backend, _ = work.result()
            try:
                self._stop(backend)
            except Exception:
                log.exception("closing a model loaded during the server's stop failed")

    async def _unload(self, slot: ModelSlot, why: str) -> None:
        backend = slot.backend
        log.info("model %s: unloading (%s)", slot.name, why)
        begin = time.monotonic()
        try:
            await asyncio.to_thread(self._stop, backend)
        except Exception:  # its memory may still be held; the model is gone for requests either way
            log.exception("model %s: unloading failed", slot.name)
        self.registry.unloaded(slot)
        log.info("model %s: unloaded in %.1f s", slot.name, time.monotonic() - begin)
        self._notify()

    def reap(self) -> None:
        """Unload the models idle past their keep-alive."""
        for slot in self.registry.expired():
            self.registry.unloading(slot)
            self._spawn(self._unload(slot, f"idle for {slot.spec.keep_alive_s:g} s"))

    async def reap_forever(self) -> None:
        """The keep-alive's clock: runs for the server's life (http_app's lifespan)."""
        while True:
            await asyncio.sleep(self.tick_s)
            self.reap()

    def close(self) -> None:
        """When the server has stopped (no loop runs): unload every loaded model, its tier writes finished."""
        for slot in self.registry.slots.values():
            if slot.backend is not None:
                try:
                    self._stop(slot.backend)
                except Exception:
                    log.exception("model %s: closing failed", slot.name)
                self.registry.unloaded(slot)

    # -- waiting --------------------------------------------------------------------

    def _spawn(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)  # a task nobody holds may be collected before it ends
        task.add_done_callback(self._tasks.discard)

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def _wait(self, deadline: float) -> bool:
        """Until a state changes or a tick passes (requests end on engine threads, unseen here);
        False once `deadline` has passed."""
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if self._changed is None:
            self._changed = asyncio.Event()
        try:
            await asyncio.wait_for(self._changed.wait(), min(left, self.tick_s))
        except asyncio.TimeoutError:
            self.reap()
        return True


async def routed(request, requested: str, stream: bool = False):
    """The backend of the model a request names, leased until its response has been sent
    (http_app's ModelLeases releases it). A stream whose model must load first opens at once
    (loading_stream.py): LoadPending carries the load to the endpoint, which calls the
    handler again once the model is leased."""
    router = request.app.state.models
    slot = getattr(request.state, "model_slot", None)
    if slot is None:
        if stream and not router.is_loaded(requested):
            raise LoadPending(asyncio.get_running_loop().create_task(router.acquire(requested)))
        slot = await router.acquire(requested)
        request.state.model_slot = slot
    request.state.backend = slot.backend
    return slot.backend
