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
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mlxkv.chat import prompting
from mlxkv.chat.system_head import SystemHeads
from mlxkv.engine.limits import RequestLimits
from mlxkv.engine.records import is_last
from mlxkv.errors import MlxkvError
from mlxkv.models.embedding import CHAT, last_token_embeddings, model_kind
from mlxkv.server.api_errors import ApiError
from mlxkv.host.engine_thread import EngineThread
from mlxkv.server.image_parts import fetch_image_urls
from mlxkv.server.metrics import ServerMetrics
from mlxkv.server.prompt_heads import strip_heads
from mlxkv.server.reply_ids import DEFAULT_KEPT, ReplyIds
from mlxkv.vision.images import MAX_IMAGE_PIXELS, has_images, image_parts
from mlxkv.vision.model import VisionModel
from mlxkv.vision.prompt import MAX_IMAGES, vision_prompt
from mlxkv.host.request_handle import RequestHandle

log = logging.getLogger(__name__)
IMAGE_URL_MAX_BYTES = 32 << 20  # an image a URL names, at most

# Requests queued or running at once; past this a client is told to come back.
DEFAULT_MAX_OPEN = 256
RETRY_AFTER_S = 1
# A reply's length when the request does not say (Anthropic's API requires
# max_tokens; OpenAI's does not). Cut to the room the context and pool leave.
DEFAULT_MAX_TOKENS = 2048
REPLY_LOG = "reply-ids.jsonl"
# Tokens decoded on each side of where a prompt stopped matching the cache (DEBUG).
REUSE_CONTEXT = 8


@dataclass(frozen=True)
class ModelInfo:
    """What the HTTP side may read of the loaded model: all immutable after loading."""

    name: str  # the short id clients see (/v1/models, each reply's "model")
    tokenizer: object
    limits: RequestLimits
    max_context: int | None
    # Where reply ids outlive the process: beside the SSD tier's blocks for this model.
    reply_log: Path | None = None
    block_size: int = 16
    tiers: str = ""  # the cache's tiers, for the start-up line
    vision: object = None  # a VisionModel: its processor and image token (read-only) build image prompts
    nbytes: int = 0  # the weights and the pool's budget: what the model holds in memory at most
    kind: str = CHAT  # or "embedding" (models/embedding.py): which requests it serves
    hybrid: bool = False  # recurrent layers: a chat's system-and-tools head is worth a checkpoint


@dataclass(frozen=True)
class ChatPrompt:
    tokens: list[int]
    head: int  # tokens of a system-and-tools head, in whole blocks (chat/system_head.py); 0: none


def not_for_replies(info: ModelInfo) -> ApiError:
    """The 400 of a generating endpoint asked of an embedding model."""
    return ApiError(400, f"model {info.name!r} is an {info.kind} model: it serves /v1/embeddings, not replies",
                    param="model")


def short_name(model: str) -> str:
    """A model's id for clients: a directory's or file's name, else the name as given (a Hugging Face id)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve().name
    if path.is_file():
        return path.stem
    return model


def _footprint(core) -> int:
    """Bytes of the weights and of the pool at its budget (a stand-in core may lack them: 0)."""
    from mlx.utils import tree_flatten

    model, layout = getattr(core.loaded, "model", None), core.kv_layout
    weights = 0 if model is None else sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    return weights + core.block_pool.budget * getattr(layout, "bytes_per_block", 0)


def _model_info(name: str, engine) -> ModelInfo:
    core = engine.core
    config, block_size = core.config.tiers, core.kv_layout.block_size
    disk = config.disk_tier
    log_path = None if disk is None else Path(disk).expanduser() / core.fingerprint.hex() / REPLY_LOG
    tiers = [f"pool {core.block_pool.budget} blocks of {block_size} tokens"]
    if config.memory_tier_bytes:
        tiers.append(f"memory tier {config.memory_tier_bytes >> 20} MiB")
    if disk is not None:
        tiers.append(f"SSD tier {disk}")
    if config.remote_tier is not None:
        from mlxkv.remote_url import redact

        tiers.append(f"remote tier {redact(config.remote_tier)}")
    model = getattr(core.loaded, "model", None)
    vision = model if isinstance(model, VisionModel) else None
    return ModelInfo(name, core.tokenizer, core.limits, core.loaded.max_context, log_path,
                     block_size, ", ".join(tiers), vision, _footprint(core),
                     model_kind(getattr(core.loaded, "config", {}) or {}),
                     hybrid=core.hybrid)


class RecordReader:
    """A request's records on the event loop, without a thread per waiting request.

    The engine thread wakes the loop through the handle's `notify`; `next`
    waits for records with a timeout, so a stream can send keep-alives and
    notice a shutdown while a long prefill runs.
    """

    def __init__(self, handle: RequestHandle):
        self.handle = handle
        self.finished = False
        self._arrived = asyncio.Event()
        loop = asyncio.get_running_loop()

        def wake() -> None:  # on the engine thread: it must never raise there
            try:
                loop.call_soon_threadsafe(self._arrived.set)
            except RuntimeError:  # the server's loop has closed: nobody is waiting
                pass

        handle.notify = wake

    async def next(self, timeout: float | None = None) -> list | None:
        """The records that arrived, up to the last one; None when `timeout` s passed without any."""
        while True:
            batch = self.handle.drain()
            if batch:
                self.finished = is_last(batch[-1])
                return batch
            try:
                await asyncio.wait_for(self._arrived.wait(), timeout)
            except asyncio.TimeoutError:
                return None
            self._arrived.clear()

    def close(self) -> bool:
        """Stop reading; a reply that had not ended is cancelled (True), its blocks back at the next step."""
        self.handle.notify = None
        if self.finished:
            return False
        self.finished = True
        self.handle.cancel()
        return True


class ServingBackend:
    """Requests are submitted from the event loop's thread only, so the
    open-request check and the submit that follows it cannot interleave."""

    def __init__(self, thread: EngineThread, name: str, *, max_open: int = DEFAULT_MAX_OPEN,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS, reply_ids_kept: int = DEFAULT_KEPT,
                 reply_cap: int | None = None, image_limits: tuple[int, int] = (MAX_IMAGE_PIXELS, MAX_IMAGES),
                 allow_image_urls: bool = False, display_name: str | None = None,
                 metrics: ServerMetrics | None = None, on_reply=None):
        self.thread = thread
        self.image_limits = image_limits  # (pixels per image, images per request)
        self.allow_image_urls = allow_image_urls
        self.max_open = max_open
        self.default_max_tokens = default_max_tokens
        self.reply_cap = reply_cap
        self.metrics = metrics or ServerMetrics()  # a server of several models shares one
        self.on_reply = on_reply or (lambda stats: None)  # the model registry's per-model counts
        thread.wait_ready()
        shown = display_name or short_name(name)
        self.info = thread.call(lambda e: _model_info(shown, e)).result()
        self.reply_ids = ReplyIds(reply_ids_kept, self.info.reply_log)
        self.created = int(time.time())  # /v1/models: when this model was loaded
        # When the server stops, open replies end here (monotonic time), each
        # with its API's final event, before uvicorn would cancel them.
        self.stop_at: float | None = None
        self._tools_checked = False
        self._tools_lock = threading.Lock()
        self._heads = SystemHeads()  # a hybrid's system-and-tools heads, rendered once per text

    # -- prompts (blocking: call through a worker thread) ---------------------

    def chat_prompt(self, messages: list[dict], tools: list | None = None) -> ChatPrompt:
        """The chat's prompt and where its system-and-tools head ends (a hybrid's only: the
        head costs a second render, and only a hybrid keeps a checkpoint there)."""
        tokens = self.chat_tokens(messages, tools)
        head = 0
        if self.info.hybrid and not has_images(messages):
            head = self._heads.length(self.info.tokenizer, strip_heads(messages), tools, tokens, self.info.block_size)
        return ChatPrompt(tokens, head)

    def chat_tokens(self, messages: list[dict], tools: list | None = None) -> list[int]:
        if has_images(messages):  # ids with the images' placeholders, and the images (vision/prompt.py)
            return self._vision_prompt(strip_heads(messages))
        messages = self.reply_ids.attach(strip_heads(messages))
        if tools:
            self._warn_if_tools_unrendered(tools)
        try:
            return prompting.chat_prompt(self.info.tokenizer, messages, model_name=self.info.name, tools=tools)
        except MlxkvError as e:
            raise ApiError(400, str(e)) from None
        except Exception as e:  # a template's own error (jinja's) is about the messages it was given
            log.warning("chat template failed: %s: %s", type(e).__name__, e)
            raise ApiError(400, f"the model's chat template refused these messages: {e}") from None

    def _vision_prompt(self, messages: list[dict]):
        if self.info.vision is None:
            where = image_parts(messages)[0][0]  # the part as the client sent it, in its API's terms
            raise ApiError(400, f"{where}: {self.info.name} takes text only (it has no vision tower loaded)")
        fetch_image_urls(messages, self.allow_image_urls, IMAGE_URL_MAX_BYTES)
        try:
            return vision_prompt(self.info.vision, messages, *self.image_limits)
        except MlxkvError as e:
            raise ApiError(400, str(e)) from None
        except ValueError as e:  # the model's processor refused decoded images (mlx-vlm raises ValueError)
            log.warning("image processor failed: %s", e)
            where = ", ".join(w for w, _ in image_parts(messages))
            raise ApiError(400, f"{where}: the model's image processor refused these images: {e}") from None

    def _warn_if_tools_unrendered(self, tools: list) -> None:
        """Once per server: a template that ignores `tools` drops them silently
        (an agent's 29k-token prompt became 7.7k), so say so."""
        with self._tools_lock:
            if self._tools_checked:
                return
            self._tools_checked = True
        probe = [{"role": "user", "content": "hi"}]
        try:
            rendered = prompting.chat_prompt(self.info.tokenizer, probe, tools=tools) != \
                prompting.chat_prompt(self.info.tokenizer, probe)
        except Exception as e:  # the request's own templating names the problem
            log.debug("could not check how the template renders tools: %s", e)
            return
        if not rendered:
            log.warning("the chat template of %s does not render tools: requests' tools are left out of "
                        "the prompt, so the model never sees them (use a model whose template has tools)",
                        self.info.name)

    def text_tokens(self, text: str) -> list[int]:
        return list(self.info.tokenizer.encode(text))

    @property
    def longest_input(self) -> int:
        """Tokens per input to /v1/embeddings: the context, else what the pool holds."""
        info = self.info
        return info.limits.pool_tokens if info.max_context is None else info.max_context

    def embed(self, token_lists: list[list[int]]) -> Future:
        """One normalized vector per token list, rows of a float32 array (on the engine thread)."""
        return self.thread.call(lambda e: np.stack([np.array(v) for v in last_token_embeddings(e.model, token_lists)]))

    def token_ids(self, ids: list[int]) -> list[int]:
        try:
            return self.info.limits.token_ids(ids)
        except MlxkvError as e:
            raise ApiError(400, str(e), param="prompt") from None

    def reply_limit(self, tokens: list[int], max_tokens: int | None, *, param: str = "messages",
                    anthropic: bool = False) -> int:
        """The reply's max_tokens: the request's (default --max-tokens), cut to
        the room the context and the pool leave. Only a prompt that does not
        fit by itself is a 400, in the wording each API's clients recognise
        (Claude Code compacts its conversation on Anthropic's)."""
        if self.info.kind != CHAT:  # every generating endpoint asks for its reply's room: refused here
            raise not_for_replies(self.info)
        limits = self.info.limits
        n = len(tokens)
        if not n:
            raise ApiError(400, "the prompt is empty", param=param)
        pool_room = limits.pool_tokens - n  # what the pool holds after the prompt
        longest = limits.pool_tokens - 1 if limits.max_context is None else min(limits.max_context,
                                                                                   limits.pool_tokens - 1)
        if n > longest or pool_room < 1:
            if anthropic:
                raise ApiError(400, f"prompt is too long: {n} tokens > {longest} maximum")
            where = "the model's context" if longest == limits.max_context else "the KV pool (--num-blocks)"
            raise ApiError(400, f"the prompt is too long: {n} tokens, more than the {longest} of {where}",
                           param=param)
        wanted = self.default_max_tokens if max_tokens is None else max_tokens
        if self.reply_cap is not None:
            wanted = min(wanted, self.reply_cap)
        return max(1, min(limits.reply_room(n, wanted), pool_room))

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

    # -- a reply's end: the backend owns the metrics and the reply ids ----------

    def reply_ended(self, prompt: list[int], text: str, ids: list[int], stats) -> None:
        """A reply came to its end: count it, say where its prompt's reuse stopped, keep its ids."""
        self.metrics.reply_done(stats)
        self.on_reply(stats)
        self.log_reuse(prompt, stats)
        if stats is not None and stats.constrained:
            log.debug("constrained reply: %d tokens, masks %.2f ms, %d tokens masked out",
                      stats.generation_tokens, stats.mask_s * 1e3, stats.masked_tokens)
        self.reply_ids.remember(text, ids)

    def reply_cancelled(self) -> None:
        self.metrics.request_cancelled()

    def request_done(self, path: str, status: int) -> None:
        self.metrics.request_done(path, status)

    def log_reuse(self, tokens: list[int], stats) -> None:
        """At DEBUG: where the prompt stopped matching the cache, with a few tokens each side."""
        if not log.isEnabledFor(logging.DEBUG) or stats is None:
            return
        cached = sum(stats.cached_tokens.values())
        if cached >= len(tokens) - self.info.block_size:
            log.debug("prompt of %d tokens: %d cached, all its full blocks", len(tokens), cached)
            return
        decode = self.info.tokenizer.decode
        before, after = decode(tokens[max(0, cached - REUSE_CONTEXT):cached]), decode(
            tokens[cached:cached + REUSE_CONTEXT])
        log.debug("prompt of %d tokens: %d cached; it stopped matching the cache in the block from token %d: "
                  "%r | %r", len(tokens), cached, cached, before, after)

    def close(self) -> None:
        self.reply_ids.close()

    def stats(self) -> dict:
        """engine.stats() as of the engine's last step or idle (never waits for a step)."""
        return dict(self.thread.published or {})
