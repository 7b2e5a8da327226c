"""A reply as both APIs need it: content deltas, tool calls and how it ended.

The engine streams one record per token. Between it and an API's JSON sit
the tool-call splitter (tool_calls.py), the stop strings (stop_strings.py),
the reply-id memory (reply_ids.py) and the metrics; this puts them in order
once, so the OpenAI and Anthropic handlers only format `ReplyEvent`s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from mlxkv.engine.records import RequestFailed, RequestStats, is_last
from mlxkv.server.api_errors import ApiError
from mlxkv.server.backend import RecordReader
from mlxkv.server.stop_strings import StopStrings
from mlxkv.server.tool_calls import ToolCall, ToolCallSplitter, tool_calling

log = logging.getLogger(__name__)

# How often a waiting reply looks up from its queue: for keep-alives, and
# to end at a shutdown's deadline.
POLL_S = 0.25


@dataclass
class ReplyEvent:
    text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    # On the last event: "stop", "length", "tool_calls" or "stop_sequence".
    finish_reason: str | None = None
    stop_sequence: str | None = None
    stats: RequestStats | None = None
    # A keep-alive: nothing new for a while (a long prefill); streams send a ping.
    waiting: bool = False


@dataclass
class WholeReply:
    text: str
    tool_calls: list[ToolCall]
    finish_reason: str
    stop_sequence: str | None
    stats: RequestStats


class Reply:
    """One request's reply, read on the event loop: `events()` for a stream,
    `collect()` for a whole reply. Reading starts when the request is queued,
    so a stream's headers and opening events go out before its prefill."""

    def __init__(self, backend, handle, prompt: list[int], stops: list[str] | None = None,
                 tools: list | None = None):
        self.backend = backend
        self.handle = handle
        self.prompt = prompt
        self.prompt_len = len(prompt)
        self._reader = RecordReader(handle)
        self._stops = StopStrings(stops or [])
        calling = tool_calling(backend.info.tokenizer) if tools else None
        self._splitter = ToolCallSplitter(*calling, tools) if calling else None
        self._ids: list[int] = []
        self._content: list[str] = []
        self.stats: RequestStats | None = None  # once it ended: for the access log
        self.cancelled = False  # its client left, or the server stopped, before it ended

    async def events(self, keepalive: float | None = None) -> AsyncIterator[ReplyEvent]:
        """The reply's events; with `keepalive`, a waiting event after that many
        seconds without one. Raises ApiError when it fails or the server stops."""
        try:
            quiet_since = time.monotonic()
            while True:
                batch = await self._reader.next(POLL_S)
                if batch is None:
                    self._check_stopping()
                    if keepalive is not None and time.monotonic() - quiet_since >= keepalive:
                        quiet_since = time.monotonic()
                        yield ReplyEvent(waiting=True)
                    continue
                quiet_since = time.monotonic()
                for record in batch:
                    event = self._read(record)
                    if event is not None:
                        yield event
                if is_last(batch[-1]):
                    return
                self._check_stopping()
        finally:
            if self._reader.close():  # the client left (a cancelled task), or a stop or failure cut it
                self.cancelled = True
                self.backend.reply_cancelled()

    async def collect(self) -> WholeReply:
        text, calls, last = [], [], ReplyEvent()
        async for event in self.events():
            text.append(event.text)
            calls += event.tool_calls
            last = event
        return WholeReply("".join(text), calls, last.finish_reason or "stop", last.stop_sequence, last.stats)

    def _check_stopping(self) -> None:
        stop_at = self.backend.stop_at
        if stop_at is not None and time.monotonic() >= stop_at:
            log.warning("the server is stopping: cut a reply after %d tokens", len(self._ids))
            raise ApiError(503, "the server is shutting down; this reply was cut short")

    def _read(self, record) -> ReplyEvent | None:
        if isinstance(record, RequestFailed):
            if record.finish_reason != "cancelled" or self._stops.matched is None:
                raise ApiError(500, record.message)
            return self._end(record.stats, "cancelled")
        self._ids.append(record.token)
        text, calls = record.text, []
        if self._stops.matched is None:  # after a stop string, the cancel is on its way
            if self._splitter is not None:
                text, calls = self._splitter.feed(text)
            text = self._stops.feed(text)
            if self._stops.matched is not None:
                self.handle.cancel()
        else:
            text = ""
        self._content.append(text)
        if record.finish_reason is not None:
            end = self._end(record.stats, record.finish_reason)
            end.text, end.tool_calls = text + end.text, calls + end.tool_calls
            return end
        return ReplyEvent(text, calls) if text or calls else None

    def _end(self, stats: RequestStats | None, engine_reason: str) -> ReplyEvent:
        rest, calls = "", []
        if self._stops.matched is None:
            if self._splitter is not None:
                rest, calls = self._splitter.finish()
            rest = self._stops.feed(rest) + self._stops.flush()
        self._content.append(rest)
        stats = stats or RequestStats.unknown(self.prompt_len, len(self._ids))
        self.stats = stats
        self.backend.reply_ended(self.prompt, "".join(self._content), self._ids, stats)
        made_calls = self._splitter is not None and bool(self._splitter.calls)
        if self._stops.matched is not None:
            reason = "stop_sequence"
        elif engine_reason == "length":
            reason = "length"
        else:
            reason = "tool_calls" if made_calls else "stop"
        return ReplyEvent(rest, calls, reason, self._stops.matched, stats)
