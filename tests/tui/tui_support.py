"""TUI test support: `wait_until`, and a scripted stand-in for EngineThread."""

from __future__ import annotations

import asyncio
import functools
import time

from mlxkv.host.engine_thread import EngineEvent, RequestFailed, RequestHandle
from mlxkv.host.pool_view import PoolSnapshot
from mlxkv.engine.records import GenerationChunk, RequestStats


def pilot_test(fn):
    """Run an async test in its own event loop (no async plugin needed)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))

    return run


def shown(widget) -> str:
    """The text a widget shows on screen now, borders and titles included."""
    return "\n".join(strip.text for strip in widget.render_lines(widget.size.region))


async def wait_until(pilot, predicate, timeout: float = 60.0, what: str = "") -> None:
    """Let the app run until `predicate()` holds (single pauses are flaky)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or predicate}")
        await pilot.pause(0.02)


REPLY = (
    "## A short answer\n\n"
    "The pool keeps **blocks** of 16 tokens:\n\n"
    "- a prefix hit skips prefill\n"
    "- a spill moves a block to a tier\n\n"
    "```python\nengine.stream(prompt)\n```\n"
)


def fixed_snapshot(num_blocks: int = 96) -> PoolSnapshot:
    """A pool in mid-turn: hits, hydrated blocks, new blocks and a spill."""
    states = "uuuuuuuuuuuu" + "ss" + "cccccccc" + "." * (num_blocks - 22)
    marks = "pppppmmmdddn" + "  " + "x" + " " * (num_blocks - 15)
    return PoolSnapshot(
        states=states,
        marks=marks,
        usage={"size_blocks": num_blocks, "budget_blocks": 4 * num_blocks, "free": num_blocks - 22,
               "cached_free": 8, "in_use": 14,
               "shared": 2, "cached": 22, "evictions": 1},
        tiers={"memory": {"lookups": 3, "hit_blocks": 3, "hit_tokens": 48, "stores": 4, "evictions": 0,
                          "spills": 1, "hydrations": 3, "bytes_held": 65536, "blocks_held": 4,
                          "corrupt": 0, "write_errors": 0},
               "disk": {"lookups": 3, "hit_blocks": 3, "hit_tokens": 48, "stores": 20, "evictions": 0,
                        "spills": 0, "hydrations": 3, "bytes_held": 1_310_720, "blocks_held": 20,
                        "corrupt": 0, "write_errors": 0}},
        block_size=16,
        requests=3,
        mark_counts={"p": 5, "m": 3, "d": 3, "n": 1, "x": 1},
        kv_format="q8g64",
        kv_bytes_per_token=69_632,  # Llama-3-8B: 32 layers x 8 KV heads x (128 + 8) bytes, K and V
    )


def fixed_stats(prompt_tokens: int = 200, generated: int = 42) -> RequestStats:
    return RequestStats(prompt_tokens=prompt_tokens, cached_tokens={"pool": 80, "memory": 48, "disk": 48},
                        computed_tokens=prompt_tokens - 176, generation_tokens=generated, ttft_s=0.0123,
                        prompt_tokens_per_s=1950.0, decode_tokens_per_s=87.5)


class ScriptedEngine:
    """Answers every request with `reply` in pieces, then fixed stats.

    With `auto=False` requests stay open and the test feeds `handles[i]`.
    """

    def __init__(self, on_event, *, reply: str = REPLY, auto: bool = True, snapshot: PoolSnapshot | None = None):
        self.on_event = on_event
        self.reply = reply
        self.auto = auto
        self.snapshot = snapshot or fixed_snapshot()
        self.handles: list[RequestHandle] = []
        self.requests: list[tuple[list[dict] | None, dict]] = []
        self.closed = False
        self.left_out = 0  # what a fitted request's handle says was left out (the real engine: fit_chat)
        on_event(EngineEvent("ready", "scripted", info={}, snapshot=self.snapshot))

    def submit(self, prompt=None, *, messages=None, fit_context=False, reply_room=None, **options) -> RequestHandle:
        handle = RequestHandle(len(self.handles))
        handle.left_out = self.left_out if fit_context else 0
        self.handles.append(handle)
        self.requests.append((messages, options if reply_room is None else {**options, "reply_room": reply_room}))
        if self.auto:
            self.answer(handle, options.get("max_tokens", 256))
        return handle

    def answer(self, handle: RequestHandle, max_tokens: int = 256) -> None:
        pieces = [self.reply[i:i + 7] for i in range(0, len(self.reply), 7)][:max_tokens]
        for i, piece in enumerate(pieces[:-1]):
            handle._put(GenerationChunk(piece, i))
        finish = "length" if len(pieces) == max_tokens else "stop"
        handle._put(GenerationChunk(pieces[-1], len(pieces), finish, fixed_stats(generated=len(pieces))))
        self.on_event(EngineEvent("snapshot", snapshot=self.snapshot))

    def close(self) -> None:
        self.closed = True
        for handle in self.handles:
            handle._put(RequestFailed("closed", "cancelled"))


class StuckEngine:
    """An engine that reports `events` and then never becomes ready."""

    def __init__(self, on_event, events):
        for event in events:
            on_event(event)

    def submit(self, *args, **kwargs):
        raise AssertionError("nothing may be sent before the model is ready")

    def close(self) -> None:
        pass
