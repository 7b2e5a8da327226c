"""A stream whose model is still loading opens at once.

Loading a model takes seconds to minutes, longer than clients wait for a
stream's headers. So a streaming request whose model is not loaded gets its
headers now and the keep-alives of a long prefill (SSE comments; Anthropic
`ping` events) while the model loads; then the request is handled as usual
and its stream follows on the same response. A failure after the headers
went out is an error event in the API's own form.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.responses import StreamingResponse

from mlxkv.server.api_errors import ApiError, is_anthropic_path
from mlxkv.server.http_support import SSE_HEADERS, sse

log = logging.getLogger(__name__)

KEEPALIVE_LINE = ": keep-alive\n\n"
PING = sse({"type": "ping"}, "ping")


class LoadPending(Exception):
    """Raised by `routed` for a streaming request whose model must load first: `task` leases it."""

    def __init__(self, task: asyncio.Task):
        super().__init__("the model is loading")
        self.task = task


class LoadingStream(StreamingResponse):
    """The stream, and the one place a lease the client left behind goes back: after the
    response, however it ended. The generator's own `finally` is no such place: when the
    headers' send fails (the client left at once), the generator never starts, so its
    `finally` never runs and the lease would leak (the model never unloaded)."""

    def __init__(self, request, handler, task: asyncio.Task):
        super().__init__(_after_load(request, handler, task), media_type="text/event-stream", headers=SSE_HEADERS)
        self.request, self.task = request, task

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Not handed over (the client left while its model loaded, or in the turn its load
            # finished, or before the headers went out): the lease goes back once it is taken.
            if getattr(self.request.state, "model_slot", None) is None:
                self.task.add_done_callback(lambda t: _release(self.request, t))


def loading_stream(request, handler, task: asyncio.Task) -> StreamingResponse:
    return LoadingStream(request, handler, task)


async def _after_load(request, handler, task: asyncio.Task):
    path = request.url.path
    try:
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=request.app.state.keepalive)
            if not done:
                yield PING if is_anthropic_path(path) else KEEPALIVE_LINE
        request.state.model_slot = task.result()  # leased: ModelLeases releases it at the end
        response = await handler(request)  # routed() finds the slot now
        if not isinstance(response, StreamingResponse):  # an API answered without a stream
            yield sse({"error": {"message": "the reply was not a stream", "type": "server_error"}})
            return
        async for chunk in response.body_iterator:
            yield chunk
    except ApiError as e:
        request.state.error = e.message  # for the access log
        yield _error_event(path, e)


def _release(request, task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is None:
        request.app.state.models.release(task.result())


def _error_event(path: str, error: ApiError) -> str:
    if is_anthropic_path(path):
        return sse(error.anthropic_body(), "error")
    if path.startswith("/v1/responses"):
        body = error.openai_body()["error"]
        return sse({"type": "error", "code": body["type"], "message": body["message"], "param": body["param"]},
                   "error")
    return sse(error.openai_body()) + sse("[DONE]")
