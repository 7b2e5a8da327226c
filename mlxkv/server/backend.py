"""The server's side of the engine thread: one model, one pool, every client.

HTTP handlers run on an asyncio loop; the model runs on the engine thread
(engine_thread.py). This bridges them: prompts are templated and checked
here, on a worker thread, before a request is queued (so a bad one is a 400
and never costs the engine a step), and records come back to the loop
without a thread per waiting request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from mlxkv.chat import prompting
from mlxkv.engine.limits import RequestLimits
from mlxkv.engine.records import is_last
from mlxkv.errors import MlxkvError
from mlxkv.server.api_errors import ApiError
from mlxkv.host.engine_thread import EngineThread
from mlxkv.server.metrics import ServerMetrics
from mlxkv.server.reply_ids import DEFAULT_KEPT, ReplyIds
from mlxkv.host.request_handle import RequestHandle

log = logging.getLogger(__name__)

# Requests queued or running at once; past this a client is told to come back.
DEFAULT_MAX_OPEN = 256
RETRY_AFTER_S = 1
# A reply's length when the request does not say (Anthropic's API requires
# max_tokens; OpenAI's does not). Cut to the room the context and pool leave.
DEFAULT_MAX_TOKENS = 2048
REPLY_LOG = "reply-ids.jsonl"


@dataclass(frozen=True)
class ModelInfo:
    """What the HTTP side may read of the loaded model: all immutable after loading."""

    name: str
    tokenizer: object
    limits: RequestLimits
    max_context: int | None
    # Where reply ids outlive the process: beside the SSD tier's blocks for this model.
    reply_log: Path | None = None


def _model_info(name: str, engine) -> ModelInfo:
    disk = engine.cache_config.disk_tier
    log_path = None if disk is None else Path(disk).expanduser() / engine.fingerprint.hex() / REPLY_LOG
    return ModelInfo(name, engine.tokenizer, engine.limits, engine.loaded.max_context, log_path)


class ServingBackend:
    """Requests are submitted from the event loop's thread only, so the
    open-request check and the submit that follows it cannot interleave."""

    def __init__(self, thread: EngineThread, name: str, *, max_open: int = DEFAULT_MAX_OPEN,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS, reply_ids_kept: int = DEFAULT_KEPT):
        self.thread = thread
        self.max_open = max_open
        self.default_max_tokens = default_max_tokens
        self.metrics = ServerMetrics()
        thread.wait_ready()
        self.info = thread.call(lambda e: _model_info(name, e)).result()
        self.reply_ids = ReplyIds(reply_ids_kept, self.info.reply_log)

    # -- prompts (blocking: call through a worker thread) ---------------------

    def chat_tokens(self, messages: list[dict], tools: list | None = None) -> list[int]:
        try:
            return prompting.chat_prompt(self.info.tokenizer, self.reply_ids.attach(messages),
                                         model_name=self.info.name, tools=tools)
        except MlxkvError as e:
            raise ApiError(400, str(e)) from None
        except Exception as e:  # a template's own error (jinja's) is about the messages it was given
            log.warning("chat template failed: %s: %s", type(e).__name__, e)
            raise ApiError(400, f"the model's chat template refused these messages: {e}") from None

    def text_tokens(self, text: str) -> list[int]:
        return list(self.info.tokenizer.encode(text))

    def token_ids(self, ids: list[int]) -> list[int]:
        try:
            return self.info.limits.token_ids(ids)
        except MlxkvError as e:
            raise ApiError(400, str(e), param="prompt") from None

    def check(self, tokens: list[int], max_tokens: int | None) -> int:
        """The reply's max_tokens (default: the room left in the context); 400 when it cannot fit."""
        limits = self.info.limits
        if max_tokens is None:
            room = min(limits.reply_room(len(tokens), self.default_max_tokens), limits.pool_tokens - len(tokens))
            max_tokens = max(1, room)
        elif tokens and limits.reply_room(len(tokens), max_tokens) < max_tokens:
            raise ApiError(400, f"max_tokens {max_tokens} is beyond the context: the prompt has {len(tokens)} "
                                f"tokens of the model's {limits.max_context}", param="max_tokens")
        try:
            limits.check(tokens, max_tokens)
        except MlxkvError as e:
            raise ApiError(400, str(e)) from None
        return max_tokens

    # -- generation -------------------------------------------------------

    def submit(self, tokens: list[int], **options) -> RequestHandle:
        """Queue a checked prompt; 429 when the queue is full."""
        retry = {"Retry-After": str(RETRY_AFTER_S)}
        if self.thread.open_requests >= self.max_open:
            raise ApiError(429, f"the server has {self.max_open} requests open, its limit; retry shortly",
                           headers=retry)
        try:
            return self.thread.submit(tokens, **options)
        except MlxkvError as e:  # the engine is closing
            raise ApiError(503, str(e), headers=retry) from None

    async def records(self, handle: RequestHandle) -> AsyncIterator[list]:
        """The request's records, in lists as they arrive; cancels it if the caller stops early."""
        loop = asyncio.get_running_loop()
        arrived = asyncio.Event()

        def wake() -> None:  # on the engine thread: it must never raise there
            try:
                loop.call_soon_threadsafe(arrived.set)
            except RuntimeError:  # the server's loop has closed: nobody is waiting
                pass

        handle.notify = wake
        finished = False
        try:
            while True:
                batch = handle.drain()
                if not batch:
                    await arrived.wait()
                    arrived.clear()
                    continue
                finished = is_last(batch[-1])
                yield batch
                if finished:
                    return
        finally:
            if not finished:
                handle.cancel()  # the client went away: its blocks go back at the next step
                self.metrics.request_cancelled()
            handle.notify = None

    def close(self) -> None:
        self.reply_ids.close()

    async def pool_usage(self) -> dict:
        return await asyncio.wrap_future(self.thread.call(lambda e: e.block_pool.usage()))

    async def stats(self) -> dict:
        return await asyncio.wrap_future(self.thread.call(lambda e: e.stats()))
