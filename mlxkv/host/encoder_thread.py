"""The thread that owns an encoder embedding model's MLX state.

An encoder (models/encoder.py) has no pool and no batch loop, so it needs
none of EngineThread's stepping: it loads on its own thread (MLX streams
belong to the thread that made them), then runs the calls queued to it,
one at a time, until it is closed. `call`, `wait_ready`, `close`,
`open_requests`, `alive` and `published` read as EngineThread's do, so the
server serves and unloads it like any other model.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

from mlxkv.errors import MlxkvError
from mlxkv.models.encoder import load_encoder

log = logging.getLogger(__name__)
_CLOSE = object()


class EncoderThread:
    def __init__(self, source: str, *, load: Callable = load_encoder):
        self.model = source
        self._load = load
        self._queue: queue.Queue = queue.Queue()
        self._ready = threading.Event()
        self._lock = threading.Lock()  # so no call is queued behind the close
        self._closed = False
        self._queued, self._ended = 0, 0  # each with its one writer: callers, and this thread
        self.encoder = None  # read it only on this thread (through call)
        self.error: str | None = None
        self.published: dict = {}  # no pool, no tiers: nothing for /v1/cache/stats
        self._thread = threading.Thread(target=self._main, name="mlxkv-encoder", daemon=True)

    def start(self) -> EncoderThread:
        self._thread.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the model is loaded; raise MlxkvError if it failed."""
        if not self._ready.wait(timeout):
            raise TimeoutError(f"model {self.model!r} did not load in {timeout} s")
        if self.error is not None:
            raise MlxkvError(self.error)

    def call(self, fn: Callable) -> Future:
        """Run `fn(encoder)` on this thread."""
        future: Future = Future()
        with self._lock:
            if self._closed:
                future.set_exception(MlxkvError("the model is unloading"))
                return future
            self._queued += 1
            self._queue.put((fn, future))
        return future

    def close(self, timeout: float | None = 30.0) -> None:
        """Finish the calls queued, then end the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(_CLOSE)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def open_requests(self) -> int:
        return self._queued - self._ended

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _main(self) -> None:
        import mlx.core as mx

        stream = mx.new_thread_local_stream(mx.default_device())
        with mx.stream(stream):
            self._start()
            while (item := self._queue.get()) is not _CLOSE:
                self._run(*item)
        mx.synchronize(stream)  # as EngineThread: a stream outliving its thread aborts the exit
        mx.clear_streams()

    def _start(self) -> None:
        try:
            self.encoder = self._load(self.model)
        except Exception as e:  # any load failure becomes one line for the user
            if not isinstance(e, MlxkvError):
                log.exception("loading %s failed", self.model)
            self.error = str(e) if isinstance(e, MlxkvError) else f"could not load model {self.model!r}: {e}"
        self._ready.set()

    def _run(self, fn: Callable, future: Future) -> None:
        try:
            if self.error is not None:
                raise MlxkvError(self.error)
            future.set_result(fn(self.encoder))
        except Exception as e:
            future.set_exception(e)
        finally:
            self._ended += 1
