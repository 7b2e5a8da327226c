"""A thread that owns one model's MLX state: the life both kinds of model thread share.

Like mlx-lm's server, the thread loads the model itself and makes its own
MLX stream (streams belong to the thread that made them), then serves what
is queued to it until it is closed. EngineThread (a decoder, its pool and
batch loop) and EncoderThread (an embedding encoder) fill in `_own` (load,
then serve) and `_queue_close`.
"""

from __future__ import annotations

import threading

from mlxkv.errors import MlxkvError


class MlxThread:
    def __init__(self, model: str, name: str):
        self.model = model
        self.error: str | None = None  # why the load failed
        self._ready = threading.Event()  # set once the load ended, well or not
        self._lock = threading.Lock()  # so nothing is queued behind the close
        self._closed = False
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)

    def start(self):
        self._thread.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the model is loaded; raise MlxkvError if it failed."""
        if not self._ready.wait(timeout):
            raise TimeoutError(f"model {self.model!r} did not load in {timeout} s")
        if self.error is not None:
            raise MlxkvError(self.error)

    def close(self, timeout: float | None = 30.0) -> None:
        """Queue the close (the thread finishes what it must first), and wait for the thread to end."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue_close()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _main(self) -> None:
        import mlx.core as mx

        stream = mx.new_thread_local_stream(mx.default_device())
        with mx.stream(stream):
            self._own()
        # A stream outliving its thread made the interpreter's exit abort
        # ("terminate called without an active exception", exit code 134)
        # after any request; MLX asks threads to free their streams first.
        mx.synchronize(stream)
        mx.clear_streams()
        self._ended()

    def _own(self) -> None:
        """On the thread, in its stream: load the model, then serve until the close."""
        raise NotImplementedError

    def _queue_close(self) -> None:
        raise NotImplementedError

    def _ended(self) -> None:
        """On the thread, once its stream is freed."""
