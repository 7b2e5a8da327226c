"""The Python API: load a model onto a paged KV pool and generate."""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable, Iterator

import mlx.core as mx

from mlxkv.chat import prompting
from mlxkv.chat.system_head import SystemHeads
from mlxkv.config import CacheConfig, EngineConfig, engine_config
from mlxkv.engine.core import MAX_RUNNING, PREFILL_STEP, build_core  # noqa: F401  (PREFILL_STEP: re-exported)
from mlxkv.engine.records import GenerationChunk, GenerationResult, RequestFailed
from mlxkv.engine.request import Request
from mlxkv.engine.results import collect, failed_result
from mlxkv.engine.sampling import make_request_sampler, whole
from mlxkv.errors import MlxkvError, error_line
from mlxkv.models.loader import LoadedModel, load_named
from mlxkv.system.wired import Device
from mlxkv.vision.image_keys import keyed_root
from mlxkv.vision.images import has_images
from mlxkv.vision.prompt import VisionPrompt, fitted_vision_prompt, vision_prompt

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256


class Engine:
    """A model on a paged, prefix-cached KV pool, generating for one thread at a time.

    The Python API over one `EngineCore` (engine/core.py): prompts, request
    checks, and generation driven through the core's surface. `prefill_chunk`
    is the most prompt tokens one step computes, solo and batched alike (same
    chunks, same numerics); `max_running` the most sequences decoding at once.
    """

    def __init__(self, loaded: LoadedModel, config: CacheConfig | EngineConfig | None = None, *,
                 prefill_chunk: int = PREFILL_STEP, max_running: int = MAX_RUNNING, device: Device | None = None,
                 core=None):
        """`core`: one built already (a rank's of a distributed set: distributed/rank_engine.py)."""
        self.config = engine_config(config)  # the split config (config.py); a CacheConfig is its flat builder
        self.core = core or build_core(loaded, self.config, prefill_chunk=prefill_chunk, max_running=max_running,
                                       device=device)
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self._request_ids = itertools.count()
        self._heads = SystemHeads()  # chat(): a hybrid's system head, rendered once per system text

    @classmethod
    def load(cls, model: str, config: CacheConfig | EngineConfig | None = None, *, report=None,
             distributed: str | None = None, distributed_check: bool = False, backend: str = "any",
             **cache_fields) -> Engine:
        """Load `model` (a path, a Hugging Face id, or "demo") onto a new pool.

        `config` or the CacheConfig fields as keywords (block_size=16,
        disk_tier=...); `report(text, fraction)` hears of downloads and loading.
        `distributed` ("tensor" or "pipeline"): this process is one rank of a set started
        by `mlx.launch` over `backend` (docs/distributed.md); rank 0's engine drives the set,
        every other rank's serves it with `engine.core.follow()`."""
        if config is not None and cache_fields:
            raise MlxkvError("give a config or its fields as keywords, not both")
        config = config or CacheConfig(**cache_fields)
        report = report or (lambda text, fraction=None: None)
        if distributed is not None:
            from mlxkv.distributed.rank_engine import load_rank_engine

            return load_rank_engine(model, config, kind=distributed, backend=backend, check=distributed_check,
                                    report=report)
        loaded = load_named(model, report)
        report("sizing the KV pool and opening the cache tiers", None)
        return cls(loaded, config)

    # -- the core's parts, read-only, for tests and benchmarks -----------------

    kv_layout = property(lambda self: self.core.kv_layout)
    fingerprint = property(lambda self: self.core.fingerprint)
    limits = property(lambda self: self.core.limits)
    kv_pool = property(lambda self: self.core.kv_pool)
    connector = property(lambda self: self.core.connector)
    coordinator = property(lambda self: self.core.coordinator)
    block_pool = property(lambda self: self.core.block_pool)
    attention = property(lambda self: self.core.attention)
    runner = property(lambda self: self.core.runner)
    loop = property(lambda self: self.core.loop)
    draft = property(lambda self: self.core.draft, doc="the draft model's core, under speculative=\"draft\"")
    checkpoints = property(lambda self: self.core.checkpoints, doc="a hybrid's checkpoint store, else None")
    structured = property(lambda self: self.core.structured, doc="the grammars compiled for this model, cached")

    # -- prompts ----------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    @property
    def has_chat_template(self) -> bool:
        return prompting.has_chat_template(self.tokenizer)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """The chat's prompt ids; replies that carry their generated ids keep them (reply_tokens.py)."""
        return prompting.chat_prompt(self.tokenizer, messages, add_generation_prompt, self.loaded.name)

    def chat_prompt(self, messages: list[dict], max_tokens: int | None = None,
                    fit: bool = False) -> tuple[list[int], int]:
        """The prompt of chat `messages`, and how many messages were left out.

        With `fit`, a chat longer than the context loses its oldest turns
        (context_window.py); otherwise nothing is left out, and the request
        check refuses a prompt that is too long.
        """
        images = has_images(messages)  # the chat app's `/image`: its images keyed by content
        max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
        if not fit or not whole(max_tokens) or max_tokens < 1:  # a bad option is named by the request check
            return (vision_prompt(self.model, messages) if images else self.apply_chat_template(messages)), 0
        limit = self.limits.prompt_limit(max_tokens)
        if images:  # whole turns are left out, so never part of an image
            return fitted_vision_prompt(self.model, messages, limit)
        return prompting.fitted_chat_prompt(self.tokenizer, messages, limit, self.loaded.name)

    def prompt_tokens(self, prompt) -> list[int]:
        """A prompt's ids: text is encoded, ids are checked against the vocabulary."""
        if isinstance(prompt, str):
            return self.encode(prompt) if prompt else []
        return self.limits.token_ids(prompt.tokens if isinstance(prompt, VisionPrompt) else prompt)

    # -- generation -------------------------------------------------------

    def generate(self, prompt, **kwargs) -> GenerationResult:
        """Generate a whole reply to `prompt` (text or token ids)."""
        prompt_tokens = self.prompt_tokens(prompt)
        keep = prompt if isinstance(prompt, VisionPrompt) else prompt_tokens  # its images go with it
        return collect(list(self.stream(keep, **kwargs)), prompt_tokens)

    def chat(self, messages: list[dict], **kwargs) -> GenerationResult:
        """Reply to chat messages. For the next turn, append `result.as_message()`
        (the reply with its ids): then the whole of this turn is a prefix hit."""
        if has_images(messages):  # image parts: a path, bytes, a PIL image or a data: URL
            return self.generate(vision_prompt(self.model, messages), **kwargs)
        prompt = self.apply_chat_template(messages)
        return self.generate(prompt, **{"head": self.chat_head(messages, prompt), **kwargs})

    def chat_head(self, messages: list[dict], prompt) -> int:
        """Where the chat prompt's system messages end (chat/system_head.py): a branch point
        worth a checkpoint for a hybrid; 0 for any other model, which need not render it."""
        if self.coordinator.recurrent is None or isinstance(prompt, VisionPrompt):
            return 0
        return self._heads.length(self.tokenizer, messages, None, prompt, self.config.pool.block_size)

    def stream(self, prompt, should_stop: Callable[[], bool] | None = None, **options) -> Iterator[GenerationChunk]:
        """Yield one `GenerationChunk` per generated token; the last carries stats.

        Options: max_tokens (256), temperature, top_p, top_k, min_p, seed,
        cache_salt, speculative (False: this request decodes without
        proposals, when the engine speculates), head (tokens: where the
        prompt's system-and-tools head ends, chat/system_head.py; a hybrid
        keeps a checkpoint there), grammar (a structured.Grammar
        the reply must match: a JSON schema, Lark, a regex). The request runs on the engine's batch loop, so streams
        consumed side by side decode as one batch. `should_stop` is asked
        after each token; when it says yes the reply ends there with
        finish_reason "cancelled" (before the first token: no chunks).
        Closing the generator ends the request and releases its blocks.
        """
        records: deque = deque()
        request = self.make_request(prompt, records.append, should_stop, **options)
        if not self.core.has_work:
            mx.reset_peak_memory()
        self.core.add(request)
        try:
            while True:
                while not records:
                    self.core.step()
                record = records.popleft()
                if isinstance(record, RequestFailed):
                    if record.finish_reason == "cancelled":
                        return
                    raise MlxkvError(record.message)
                yield record
                if record.finish_reason is not None:
                    return
        finally:
            self.core.abort(request)

    def generate_batch(self, prompts: list, **options) -> list[GenerationResult]:
        """Whole replies to several prompts, generated as one continuous batch.

        Options as for `stream` (without should_stop). A bad prompt fails
        alone: its result has finish_reason "error" and `extra["error"]`.
        """
        records: list[list] = [[] for _ in prompts]
        results: list[GenerationResult | None] = [None] * len(prompts)
        for i, prompt in enumerate(prompts):
            try:
                self.core.add(self.make_request(prompt, records[i].append, **options))
            except Exception as e:  # a bad prompt fails alone
                results[i] = failed_result(self._tokens_or_none(prompt), error_line(e, log))
        while self.core.has_work:
            self.core.step()
        return [result or collect(recs, self.prompt_tokens(prompt))
                for result, recs, prompt in zip(results, records, prompts)]

    def _tokens_or_none(self, prompt) -> list[int]:
        try:
            return self.prompt_tokens(prompt)
        except MlxkvError:
            return []

    def make_request(self, prompt, sink, should_stop: Callable[[], bool] | None = None, speculative: bool = True,
                     grammar=None, head: int = 0, **options) -> Request:
        """A checked `Request` for the batch loop (options as for `stream`); raises MlxkvError on bad input."""
        if not isinstance(speculative, bool):
            raise MlxkvError(f"speculative must be true or false, got {speculative!r}")
        if not whole(head) or head < 0:
            raise MlxkvError(f"head must be a whole number of tokens, at least 0, got {head!r}")
        prompt_tokens, sampler, root = self._prepare(prompt, **options)
        max_tokens = self.limits.reply_room(len(prompt_tokens), options.get("max_tokens", DEFAULT_MAX_TOKENS))
        images = isinstance(prompt, VisionPrompt)  # its images key the blocks they overlap
        request = Request(
            next(self._request_ids), prompt_tokens, max_tokens, sampler,
            keyed_root(root, prompt.spans, self.config.pool.block_size) if images else root,
            sink, self.tokenizer.detokenizer, should_stop,
            speculative=speculative and self.core.speculates and not images,
            grammar=None if grammar is None else self.core.structured.matcher(grammar),
            image_spans=tuple(prompt.spans) if images else (),
            head=self._branch_point(head, len(prompt_tokens)),
        )
        if images:
            # Made at the row's first forward, on this thread, once its prefix hit is known.
            self.model.rows.attach(request, lambda computed, first: prompt.row_inputs(self.model, computed, first))
        return request

    def _branch_point(self, head: int, num_tokens: int) -> int:
        """A head's end as a branch point: whole blocks within the prompt, for a hybrid only
        (attention blocks are shared without one)."""
        if self.coordinator.recurrent is None:
            return 0
        block = self.config.pool.block_size
        return min(head, num_tokens) // block * block

    def _prepare(
        self,
        prompt,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        temperature: float = 0.0,
        top_p: float = 0.0,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: int | None = None,
        cache_salt: str | None = None,
    ):
        """A request's checked prompt tokens, its sampler and its hash root.

        Options are checked before the pool fit, so a bad one is named
        rather than a pool too small for it."""
        prompt_tokens = self.prompt_tokens(prompt)
        sampler = make_request_sampler(temperature, top_p, min_p, top_k, seed)  # checks those options
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise MlxkvError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        self.limits.check(prompt_tokens, max_tokens)
        return prompt_tokens, sampler, self.core.hash_root(cache_salt)

    # -- state ------------------------------------------------------------

    def stats(self) -> dict:
        """Pool state and configuration, as plain data."""
        return self.core.stats()

    def idle(self, seconds: float) -> None:
        """Use a pause (EngineCore.idle): checkpoints to the SSD tier, memory given back."""
        self.core.idle(seconds)

    def close(self) -> None:
        """Leave what a restart needs on the SSD tier, then finish the tiers' writes."""
        self.core.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
