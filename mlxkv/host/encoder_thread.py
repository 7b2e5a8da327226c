"""The thread that owns an encoder embedding model's MLX state.

An encoder (models/encoder.py) has no pool and no batch loop, so it needs
none of EngineThread's stepping: it loads on its own thread, then runs the
calls queued to it, one at a time, until it is closed (mlx_thread.py). `call`,
`wait_ready`, `close`, `open_requests`, `alive` and `published` read as
EngineThread's do, so the server serves and unloads it like any other model.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from concurrent.futures import Future

from mlxkv.errors import MlxkvError
from mlxkv.host.mlx_thread import MlxThread
from mlxkv.models.encoder import load_encoder

log = logging.getLogger(__name__)
_CLOSE = object()


class EncoderThread(MlxThread):
    def __init__(self, source: str, *, load: Callable = load_encoder):
        super().__init__(source, "mlxkv-encoder")
        self._load = load
        self._queue: queue.Queue = queue.Queue()
        self._queued, self._finished = 0, 0  # each with its one writer: callers, and this thread
        self.encoder = None  # read it only on this thread (through call)
        self.published: dict = {}  # no pool, no tiers: nothing for /v1/cache/stats

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

    def _queue_close(self) -> None:
        self._queue.put(_CLOSE)  # after the calls queued: they finish first

    @property
    def open_requests(self) -> int:
        return self._queued - self._finished

    def _own(self) -> None:
        self._load_encoder()
        while (item := self._queue.get()) is not _CLOSE:
            self._run(*item)

    def _load_encoder(self) -> None:
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
            self._finished += 1
