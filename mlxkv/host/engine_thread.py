"""One long-lived thread that owns all MLX state: model, stream, pool and tiers.

Like mlx-lm's server, the thread loads the model itself, makes its own MLX
stream (streams belong to the thread that made them), then serves requests
from a `queue.Queue`. Each request answers on its own queue through a
`RequestHandle`: iterate it for `GenerationChunk` records (or a
`RequestFailed`), or call `cancel()`. Requests run as one continuous batch
(engine/loop.py): a reply keeps streaming while others join, prefill or
end. Engine-wide news (load progress, ready, failure, pool snapshots) goes
to an `on_event` callback, called on the engine thread; it must not block
(a UI posts a message and returns).

    engine = EngineThread("demo", CacheConfig()).start()
    engine.wait_ready()
    for record in engine.submit(messages=[{"role": "user", "content": "Hi"}], max_tokens=32):
        print(record.text, end="")
    engine.close()
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from mlxkv.config import CacheConfig
from mlxkv.engine.records import GenerationChunk, RequestFailed, is_last  # noqa: F401  (re-exported)
from mlxkv.engine.sampling import whole
from mlxkv.errors import MlxkvError, MlxkvWarning, error_line, warning_text
from mlxkv.host.messages import Call, Close, Submit
from mlxkv.host.mlx_thread import MlxThread
from mlxkv.host.request_handle import RequestHandle

log = logging.getLogger(__name__)

# Pool snapshots during a reply: at most this often (they cost O(blocks)).
SNAPSHOT_INTERVAL_S = 0.25
# engine.stats() is published this often while steps run, and at each idle,
# so readers on other threads (a server's /metrics) never wait for a step.
STATS_INTERVAL_S = 0.25
# While no request is open the thread wakes this often to tell the engine how
# long it has been idle (Engine.idle: checkpoints to SSD, memory given back).
IDLE_TICK_S = 1.0


@dataclass
class EngineEvent:
    """Engine-wide news. kind: "progress", "ready", "failed", "snapshot" or "closed"."""

    kind: str
    text: str = ""
    fraction: float | None = None  # of a download, when known
    info: dict = field(default_factory=dict)  # "ready": engine.stats()
    snapshot: object = None  # "snapshot" and "ready": a pool_view.PoolSnapshot
    warnings: list[str] = field(default_factory=list)  # "ready": MlxkvWarnings raised while loading


def load_engine(model: str, cache: CacheConfig, report: Callable[[str, float | None], None]):
    """Fetch (download with progress if needed) and load `model` onto a new pool: Engine.load."""
    from mlxkv.engine.engine import Engine

    return Engine.load(model, cache, report=report)


@contextlib.contextmanager
def _mlxkv_warnings():
    """Collect the MlxkvWarnings raised inside (e.g. an SSD tier left off), for
    the ready event: a UI owns the terminal, so a line on stderr would be lost.
    Other warnings are shown as usual.

    warnings.catch_warnings is process-wide: a warning another thread raises
    meanwhile is caught here too, and so still shown, or still reported.
    """
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as recorded:
            warnings.simplefilter("always", MlxkvWarning)
            yield caught
    finally:
        for w in recorded:
            if issubclass(w.category, MlxkvWarning):
                caught.append(w)
            else:
                warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)


class EngineThread(MlxThread):
    def __init__(
        self,
        model: str,
        cache: CacheConfig | None = None,
        *,
        on_event: Callable[[EngineEvent], None] | None = None,
        load: Callable = load_engine,
        snapshot_interval: float = SNAPSHOT_INTERVAL_S,
        idle_tick: float = IDLE_TICK_S,
    ):
        super().__init__(model, "mlxkv-engine")
        self.cache = cache or CacheConfig()
        self.on_event = on_event or (lambda event: None)
        self._load = load
        self.snapshot_interval = snapshot_interval
        self.idle_tick = idle_tick
        self._queue: queue.Queue = queue.Queue()
        self._ids = itertools.count()
        # Requests open: counted by the submitting threads (under the lock) and by the
        # engine thread as they end, each count with its one writer; the handles of the
        # requests the engine thread has taken are its own.
        self._submitted, self._finished = 0, 0
        self._open: dict[int, RequestHandle] = {}  # taken and not finished: the engine thread's
        # Read it only on the engine thread (see call()); its tokenizer and limits, which never
        # change once it is loaded, template chats on the submitting thread (submit).
        self.engine = None
        self._snapshot_due = False
        self._next_snapshot = 0.0
        # engine.stats() as of the last step or idle: written by the engine
        # thread only (a new dict each time), read by any thread.
        self.published: dict | None = None
        self._next_publish = 0.0

    # -- any thread -------------------------------------------------------

    def submit(self, prompt=None, *, messages: list[dict] | None = None, fit_context: bool = False,
               reply_room: int | None = None, **options) -> RequestHandle:
        """Queue a request: a prompt (text or token ids) or chat messages.

        `fit_context` leaves out a chat's oldest turns when the messages are
        longer than the context (see context_window.py), leaving room for a
        reply of `reply_room` tokens (default: max_tokens); the handle's
        `left_out` says how many. A chat's prefill (max_tokens=1) passes its
        replies' max_tokens as `reply_room`, so it loads the window they
        will use. `options` go to `Engine.stream` (max_tokens, temperature, ...).
        """
        if (prompt is None) == (messages is None):
            raise ValueError("give a prompt or messages, not both")
        if self._closed:
            raise MlxkvError("the engine is closed")
        if reply_room is not None and (not whole(reply_room) or reply_room < 1):
            raise MlxkvError(f"reply_room must be a whole number, at least 1, got {reply_room!r}")
        handle = RequestHandle(next(self._ids))
        if messages is not None:
            prompt = self._chat_prompt(handle, messages, options, fit_context, reply_room)
            if prompt is None:  # failed: the handle says why
                return handle
            options = {"head": self.engine.chat_head(messages, prompt), **options}  # a hybrid's branch point
        with self._lock:  # so no request is queued behind the close
            if self._closed:
                raise MlxkvError("the engine is closed")
            self._submitted += 1
            self._queue.put(Submit(handle, prompt, options))
        return handle

    def _chat_prompt(self, handle: RequestHandle, messages: list[dict], options: dict, fit_context: bool,
                     reply_room: int | None) -> list[int] | None:
        """The chat's prompt, templated here, on the submitting thread: a long chat's template
        (and its fitting, context_window.py) never costs the batch a step. None if it failed."""
        self._ready.wait()
        if self.error is not None:
            handle._put(RequestFailed(self.error))
            return None
        room = options.get("max_tokens") if reply_room is None else reply_room
        try:
            prompt, handle.left_out = self.engine.chat_prompt(messages, room, fit=fit_context)
        except Exception as e:  # one request's failure never ends the thread
            handle._put(RequestFailed(error_line(e, log)))
            return None
        return prompt

    def call(self, fn: Callable) -> Future:
        """Run `fn(engine)` on the engine thread between requests (an error once it is closed:
        nothing queued behind the close is ever taken, so its future would never end)."""
        future: Future = Future()
        with self._lock:
            if self._closed:
                future.set_exception(MlxkvError("the engine is closed"))
            else:
                self._queue.put(Call(fn, future))
        return future

    def _queue_close(self) -> None:
        """close(): cancel open requests (the engine thread does, when it takes the close),
        finish SSD writes, and end the thread."""
        self._queue.put(Close())

    @property
    def open_requests(self) -> int:
        """Requests submitted and not finished (queued, running, or being cancelled)."""
        return self._submitted - self._finished

    # -- the engine thread ------------------------------------------------

    def _own(self) -> None:
        if self._start_engine():
            self._serve()
            self.engine.close()
        else:
            self._refuse_all()

    def _ended(self) -> None:
        self.on_event(EngineEvent("closed"))

    def _start_engine(self) -> bool:
        from mlxkv.host.pool_view import PoolWatcher

        def report(text: str, fraction: float | None = None) -> None:
            self.on_event(EngineEvent("progress", text, fraction))

        try:
            with _mlxkv_warnings() as caught:
                self.engine = self._load(self.model, self.cache, report)
            self.watcher = PoolWatcher(self.engine.core)
        except Exception as e:  # any load failure becomes one line for the user
            if isinstance(e, MlxkvError):
                self.error = str(e)
            else:
                log.exception("loading %s failed", self.model)
                self.error = f"could not load model {self.model!r}: {e}"
            self._ready.set()
            self.on_event(EngineEvent("failed", self.error))
            return False
        for w in caught:  # shown by a UI from the ready event; logged for `mlxkv serve` and the chat app's log
            log.warning("%s", warning_text(w.message))
        self._publish()
        self._ready.set()
        self.on_event(EngineEvent("ready", self.model, info=self.engine.stats(), snapshot=self.watcher.snapshot(),
                                  warnings=[warning_text(w.message) for w in caught]))
        return True

    def _serve(self) -> None:
        """Serve queued requests as one continuous batch, stepping while any is open."""
        core = self.engine.core
        closing = False
        idle_since = time.monotonic()
        while not closing or core.has_work:
            block = not closing and not core.has_work
            for message in self._take(block):
                if isinstance(message, Close):
                    closing = True
                    for handle in self._open.values():
                        handle.cancel()
                elif isinstance(message, Call):
                    self._call(message)
                else:
                    self._submit(core, message)
            if core.has_work:
                core.step()
                self._snapshot_if_due()
                idle_since = time.monotonic()
            elif block:
                self._idle(time.monotonic() - idle_since)
            self._publish_if_due(idle=not core.has_work)

    def _idle(self, seconds: float) -> None:
        try:
            self.engine.idle(seconds)
        except Exception:  # what a pause is for can wait; the thread must go on
            log.exception("the engine's idle work failed")

    def _take(self, block: bool) -> list:
        """Whatever is queued now; when `block`, wait up to an idle tick for at least one item."""
        items = []
        if block:
            try:
                items.append(self._queue.get(timeout=self.idle_tick))
            except queue.Empty:
                return items
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                return items

    def _refuse_all(self) -> None:
        while not isinstance(message := self._queue.get(), Close):
            if isinstance(message, Call):
                message.future.set_exception(MlxkvError(self.error))
            else:
                self._end(message.handle, RequestFailed(self.error))

    def _call(self, call: Call) -> None:
        try:
            call.future.set_result(call.fn(self.engine))
        except Exception as e:
            call.future.set_exception(e)

    def _submit(self, core, request: Submit) -> None:
        handle = request.handle
        self._open[handle.id] = handle
        if handle.cancelled:
            self._end(handle, RequestFailed("cancelled before it started", "cancelled"))
            return
        try:
            sink = self._sink(handle)
            queued = self.engine.make_request(request.prompt, sink, should_stop=handle._cancel.is_set,
                                              **request.options)
        except Exception as e:  # one request's failure never ends the thread
            self._end(handle, RequestFailed(error_line(e, log)))
            return
        if not core.has_work:
            self.watcher.begin()  # marks are per turn: from an idle pool on
        core.add(queued)

    def _sink(self, handle: RequestHandle) -> Callable:
        """Where the batch loop puts a request's records; notes when a snapshot is due."""
        first = [True]

        def put(record) -> None:
            if is_last(record):
                self._ended_request(handle)
                self._snapshot_due = True
            elif first[0]:  # the first token's snapshot shows the prefix hits
                first[0] = False
                self._snapshot_due = True
            handle._put(record)

        return put

    def _end(self, handle: RequestHandle, record) -> None:
        self._ended_request(handle)
        handle._put(record)
        self._snapshot_due = True

    def _ended_request(self, handle: RequestHandle) -> None:
        self._open.pop(handle.id, None)
        self._finished += 1

    def _snapshot_if_due(self) -> None:
        now = time.monotonic()
        if self._snapshot_due or now >= self._next_snapshot:
            self._snapshot()
            self._snapshot_due = False
            self._next_snapshot = now + self.snapshot_interval

    def _publish_if_due(self, idle: bool) -> None:
        now = time.monotonic()
        if idle or now >= self._next_publish:
            self._publish()
            self._next_publish = now + STATS_INTERVAL_S

    def _publish(self) -> None:
        try:
            self.published = self.engine.stats()
        except Exception:  # stats must never stop the requests they describe
            log.exception("could not read the engine's stats")

    def _snapshot(self) -> None:
        try:
            snapshot = self.watcher.snapshot()
        except Exception:  # a view of the pool must never stop the requests it shows
            log.exception("could not take a snapshot of the pool")
            return
        self.on_event(EngineEvent("snapshot", snapshot=snapshot))
