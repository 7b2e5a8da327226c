"""One request's answer, for the thread that submitted it: its records in
order, batched for a UI, and a way to stop it."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator

from mlxkv.engine.records import is_last


class RequestHandle:
    """One request's answer: its records in order, and a way to stop it."""

    def __init__(self, request_id: int):
        self.id = request_id
        self._records: queue.Queue = queue.Queue()
        self._cancel = threading.Event()
        self._finished = threading.Event()  # the last record is in the queue
        # Chat messages left out of the prompt to fit the context (submit's
        # fit_context); set before the first record.
        self.left_out = 0
        # Called on the engine thread after each record is queued (an asyncio
        # server wakes its loop with it); it must not block.
        self.notify: Callable[[], None] | None = None

    def cancel(self) -> None:
        """Stop after the next token; the reply so far is kept and ends "cancelled"."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def _put(self, record) -> None:
        self._records.put(record)
        if is_last(record):
            self._finished.set()
        notify = self.notify
        if notify is not None:
            notify()

    def drain(self) -> list:
        """The records already queued, up to and including the last one."""
        records = []
        while not (records and is_last(records[-1])):
            try:
                records.append(self._records.get_nowait())
            except queue.Empty:
                break
        return records

    def __iter__(self) -> Iterator:
        while True:
            record = self._records.get()
            yield record
            if is_last(record):
                return

    def batches(self, interval: float | Callable[[], float]) -> Iterator[list]:
        """Records in lists at most one per `interval` seconds (the first at once).

        A UI renders one update per list, so its rate does not follow the
        token rate, and the engine never waits for it. `interval` may be a
        function, asked before each list, for a UI that paces itself.
        """
        pace = interval if callable(interval) else (lambda: interval)
        last_yield = float("-inf")
        while True:
            batch = [self._records.get()]
            if not is_last(batch[-1]):
                # Sleep until the batch is due, waking early only for the
                # last record: no wake-up (and no GIL hand-off) per token.
                self._finished.wait(max(0.0, last_yield + pace() - time.monotonic()))
                batch += self.drain()
            yield batch
            last_yield = time.monotonic()
            if is_last(batch[-1]):
                return
