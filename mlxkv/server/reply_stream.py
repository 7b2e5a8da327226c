"""A reply as both APIs need it: content deltas, tool calls and how it ended.

The engine streams one record per token. Between it and an API's JSON sit
the tool-call splitter (tool_calls.py), the stop strings (stop_strings.py),
the reply-id memory (reply_ids.py) and the metrics; this puts them in order
once, so the OpenAI and Anthropic handlers only format `ReplyEvent`s.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from mlxkv.engine.records import RequestFailed, RequestStats, is_last
from mlxkv.server.api_errors import ApiError
from mlxkv.server.stop_strings import StopStrings
from mlxkv.server.tool_calls import ToolCall, ToolCallSplitter, tool_calling


@dataclass
class ReplyEvent:
    text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    # On the last event: "stop", "length", "tool_calls" or "stop_sequence".
    finish_reason: str | None = None
    stop_sequence: str | None = None
    stats: RequestStats | None = None


@dataclass
class WholeReply:
    text: str
    tool_calls: list[ToolCall]
    finish_reason: str
    stop_sequence: str | None
    stats: RequestStats


class Reply:
    """One request's reply, read on the event loop. `start()` waits for the
    first token (so a failure before it can still be an HTTP error), then
    `events()` or `collect()` reads the rest."""

    def __init__(self, backend, handle, prompt_len: int, stops: list[str] | None = None,
                 tools: list | None = None):
        self.backend = backend
        self.handle = handle
        self.prompt_len = prompt_len
        self._records = backend.records(handle)
        self._first: list = []
        self._stops = StopStrings(stops or [])
        calling = tool_calling(backend.info.tokenizer) if tools else None
        self._splitter = ToolCallSplitter(*calling, tools) if calling else None
        self._ids: list[int] = []
        self._content: list[str] = []

    async def start(self) -> None:
        try:
            self._first = await anext(self._records)
        except BaseException:
            await self._records.aclose()
            raise
        last = self._first[-1]
        if isinstance(last, RequestFailed):
            await self._records.aclose()
            raise ApiError(500, last.message)

    async def events(self) -> AsyncIterator[ReplyEvent]:
        try:
            batch = self._first
            while True:
                for record in batch:
                    event = self._read(record)
                    if event is not None:
                        yield event
                if is_last(batch[-1]):
                    return
                batch = await anext(self._records)
        finally:
            await self._records.aclose()

    async def collect(self) -> WholeReply:
        text, calls, last = [], [], ReplyEvent()
        async for event in self.events():
            text.append(event.text)
            calls += event.tool_calls
            last = event
        return WholeReply("".join(text), calls, last.finish_reason or "stop", last.stop_sequence, last.stats)

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
        self.backend.metrics.reply_done(stats)
        self.backend.reply_ids.remember("".join(self._content), self._ids)
        made_calls = self._splitter is not None and bool(self._splitter.calls)
        if self._stops.matched is not None:
            reason = "stop_sequence"
        elif engine_reason == "length":
            reason = "length"
        else:
            reason = "tool_calls" if made_calls else "stop"
        return ReplyEvent(rest, calls, reason, self._stops.matched, stats)
