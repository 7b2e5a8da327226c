"""What every endpoint needs: the body read under a size limit and checked
by a pydantic model, work moved off the event loop, SSE framing, and a
client's disconnect turned into a cancel."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from mlxkv.server.api_errors import ApiError, validation_message

DEFAULT_MAX_BODY_BYTES = 32 << 20  # a 128k-token prompt is well under 1 MiB of JSON


class Lenient(BaseModel):
    """A request model that ignores fields it does not name: clients send many
    we do not use (user, logprobs, metadata, cache_control, ...)."""

    model_config = ConfigDict(extra="ignore")


async def parse_body(request: Request, model: type[BaseModel]) -> BaseModel:
    """The request's JSON as `model`; 413 over the size limit, 400 for anything malformed."""
    body = getattr(request.state, "body", None)  # read before: a stream's handler runs again once its model loaded
    if body is None:
        body = request.state.body = await _read_body(request)
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ApiError(400, validation_message(e)) from None


async def _read_body(request: Request) -> bytes:
    limit = request.app.state.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body is {int(declared)} bytes, over the server's limit of {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"request body is over the server's limit of {limit} bytes")
    return bytes(body)


async def off_loop(fn, *args):
    """Run blocking work (templating, tokenizing) on a worker thread."""
    return await run_in_threadpool(fn, *args)


def sse(data: dict | str, event: str | None = None) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


class ClientGone(Exception):
    """The client hung up before its whole reply was ready."""


async def until_disconnect(request: Request, work):
    """Await `work` (a whole, non-streamed reply); if the client leaves first,
    cancel it (its request leaves the engine at the next step) and raise ClientGone.

    A streamed reply needs none of this: Starlette cancels the stream's task
    on a disconnect, and the reply's reader cancels the request as it closes.
    """

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():  # the client left, or this handler itself was cancelled
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()
