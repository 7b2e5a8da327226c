"""The served models' states and the rules of what may be loaded: no threads, no I/O.

A model is unloaded, loading, loaded, unloading or failed. The registry is
the one writer of every slot's fields; the router (model_router.py) asks it
what to do and tells it what happened. Its decisions:

- `plan(slot)`: which loaded models to unload so `slot` fits under
  --max-loaded and --memory-budget, least recently used first, never one
  that is pinned or has a request open (a lease, or a request the engine has
  not finished); None when nothing can go yet (the request waits).
- `expired()`: loaded models idle past their keep-alive.

A clock is passed in, so tests drive time by hand.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from mlxkv.server.model_specs import NEVER, ModelSpec

UNLOADED, LOADING, LOADED, UNLOADING, FAILED = "unloaded", "loading", "loaded", "unloading", "failed"
# A model that failed to load is tried again by a request this much later (a file may be fixed meanwhile).
RETRY_FAILED_S = 30.0


@dataclass(frozen=True)
class LoadLimits:
    max_loaded: int | None = None  # models loaded at once (None: no limit)
    memory_budget: int | None = None  # bytes of weights plus pools (None: no limit)

    def fits(self, count: int, nbytes: int) -> bool:
        return (self.max_loaded is None or count <= self.max_loaded) and \
            (self.memory_budget is None or nbytes <= self.memory_budget)


@dataclass(eq=False)
class ModelSlot:
    spec: ModelSpec
    state: str = UNLOADED
    backend: object = None  # a ServingBackend while loaded
    leases: int = 0  # requests being handled (templating, or a response still being sent)
    waiting: int = 0  # requests waiting for it to load: it is theirs once loaded, not the keep-alive's
    last_used: float = 0.0  # the clock's time of its last request's start or end
    loads: int = 0
    unloads: int = 0
    error: str | None = None  # why its last load failed
    failed_at: float = 0.0
    footprint: int = 0  # bytes of weights plus pool budget: measured once loaded, else estimated
    load_s: float | None = None  # how long its last load took
    replies: int = 0
    cached_tokens: dict = field(default_factory=dict)  # prompt tokens reused, by tier, over every load
    image_tokens: int = 0  # image tokens in its prompts, over every load
    cached_image_tokens: int = 0  # of them, served by a prefix hit

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def open_requests(self) -> int:
        thread = getattr(self.backend, "thread", None)
        return self.leases + (thread.open_requests if thread is not None else 0)

    @property
    def holds_memory(self) -> bool:
        return self.state in (LOADING, LOADED, UNLOADING)


@dataclass
class ModelRegistry:
    specs: list[ModelSpec]
    limits: LoadLimits = field(default_factory=LoadLimits)
    clock: Callable[[], float] = time.monotonic
    estimate: Callable[[ModelSpec], int] = lambda spec: 0  # bytes a model not loaded yet will take

    def __post_init__(self):
        self.slots = {spec.name: ModelSlot(spec) for spec in self.specs}

    @property
    def names(self) -> list[str]:
        return list(self.slots)

    def slot(self, name: str) -> ModelSlot:
        return self.slots[name]

    def loaded(self) -> list[ModelSlot]:
        return [s for s in self.slots.values() if s.state == LOADED]

    # -- decisions ----------------------------------------------------------

    def need(self, slot: ModelSlot) -> int:
        return slot.footprint or self.estimate(slot.spec)

    def never_fits(self, slot: ModelSlot) -> str | None:
        """Why `slot` cannot load even with every other model unloaded; None if it can."""
        budget = self.limits.memory_budget
        if budget is not None and self.need(slot) > budget:
            return (f"model {slot.name!r} needs {self.need(slot) >> 20} MiB, more than the memory budget's "
                    f"{budget >> 20} MiB (--memory-budget)")
        if self.limits.max_loaded == 0:
            return "--max-loaded is 0"
        return None

    def plan(self, slot: ModelSlot) -> list[ModelSlot] | None:
        """The models to unload, least recently used first, so `slot` fits; None if it cannot fit yet."""
        others = [s for s in self.slots.values() if s.holds_memory and s is not slot]
        candidates = sorted((s for s in others if self.unloadable(s)), key=lambda s: s.last_used)
        victims: list[ModelSlot] = []
        while not self.limits.fits(len(others) - len(victims) + 1,
                                   sum(self.need(s) for s in others if s not in victims) + self.need(slot)):
            if not candidates:
                return None
            victims.append(candidates.pop(0))
        return victims

    def unloadable(self, slot: ModelSlot) -> bool:
        return slot.state == LOADED and not slot.spec.pin and slot.open_requests == 0 and slot.waiting == 0

    def blocked_by(self) -> str:
        """Why a load waits: the loaded models and what holds each."""
        held = [f"{s.name} ({'pinned' if s.spec.pin else f'{s.open_requests} open requests'})"
                for s in self.slots.values() if s.holds_memory and not self.unloadable(s)]
        limits = []
        if self.limits.max_loaded is not None:
            limits.append(f"--max-loaded {self.limits.max_loaded}")
        if self.limits.memory_budget is not None:
            limits.append(f"--memory-budget {self.limits.memory_budget >> 20} MiB")
        return f"no room under {' and '.join(limits) or 'the limits'}: loaded and in use: {', '.join(held)}"

    def expired(self) -> list[ModelSlot]:
        """Loaded models idle for at least their keep-alive."""
        now = self.clock()
        return [s for s in self.loaded() if self.unloadable(s) and s.spec.keep_alive_s != NEVER
                and now - s.last_used >= (s.spec.keep_alive_s or 0.0)]

    def may_retry(self, slot: ModelSlot) -> bool:
        return slot.state == FAILED and self.clock() - slot.failed_at >= RETRY_FAILED_S

    def idle_s(self, slot: ModelSlot) -> float | None:
        """Seconds since the model's last use; None if it was never used."""
        return None if not slot.last_used else self.clock() - slot.last_used

    # -- what happened (the router tells) ---------------------------------------

    def lease(self, slot: ModelSlot) -> None:
        slot.leases += 1
        slot.last_used = self.clock()

    def release(self, slot: ModelSlot) -> None:
        slot.leases -= 1
        slot.last_used = self.clock()

    def wait_for(self, slot: ModelSlot) -> None:
        slot.waiting += 1

    def stop_waiting(self, slot: ModelSlot) -> None:
        slot.waiting -= 1

    def loading(self, slot: ModelSlot) -> None:
        slot.state, slot.error = LOADING, None

    def loaded_as(self, slot: ModelSlot, backend, footprint: int, load_s: float) -> None:
        slot.state, slot.backend, slot.footprint, slot.load_s = LOADED, backend, footprint, load_s
        slot.loads += 1
        slot.last_used = self.clock()

    def failed(self, slot: ModelSlot, error: str) -> None:
        slot.state, slot.backend, slot.error, slot.failed_at = FAILED, None, error, self.clock()

    def reply_done(self, slot: ModelSlot, stats) -> None:
        slot.replies += 1
        for tier, n in stats.cached_tokens.items():
            slot.cached_tokens[tier] = slot.cached_tokens.get(tier, 0) + n
        slot.image_tokens += stats.image_tokens
        slot.cached_image_tokens += stats.cached_image_tokens

    def unloading(self, slot: ModelSlot) -> None:
        slot.state = UNLOADING

    def unloaded(self, slot: ModelSlot) -> None:
        slot.state, slot.backend = UNLOADED, None
        slot.unloads += 1
