"""The Python API: load a model onto a paged KV pool and generate."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator

import mlx.core as mx

from mlxkv.attention import resolve_attention
from mlxkv.batching import BatchLoop, generate_batch
from mlxkv.block_pool import BlockPool
from mlxkv.cache_manager import KVCacheManager, blocks_for
from mlxkv.config import DEFAULT_MEMORY_SHARE, CacheConfig
from mlxkv.connectors.tiered import build_connector
from mlxkv.context_window import fit_messages
from mlxkv.errors import MlxkvError
from mlxkv.fingerprint import model_fingerprint
from mlxkv.hashing import root_hash
from mlxkv.kv_pool import KVLayout, KVPool
from mlxkv.machine import physical_memory
from mlxkv.model_loader import LoadedModel, load_model, probe_kv_layout
from mlxkv.model_runner import ModelRunner
from mlxkv.records import GenerationChunk, GenerationResult, RequestFailed, RequestStats
from mlxkv.reply_tokens import chat_tokens, is_token_list
from mlxkv.request import Request
from mlxkv.sampling import make_request_sampler, whole
from mlxkv.sequence import Sequence

DEFAULT_MAX_TOKENS = 256
# Same prefill chunk as mlx-lm's generate_step, so both compute the same
# matmul shapes and greedy output matches token for token.
PREFILL_STEP = 2048
# Without a size from the user, never hold more than this many full contexts.
MAX_DEFAULT_CONTEXTS = 16


def size_pool(cfg: CacheConfig, layout: KVLayout, max_context: int | None) -> int:
    """Number of blocks: asked for, from a byte budget, or a share of memory;
    never more than the machine's memory holds."""
    memory = physical_memory()
    blocks = _pool_blocks(cfg, layout, max_context, memory)
    need = blocks * layout.bytes_per_block
    if need > memory:
        # (machine.py: an allocation MLX cannot make is a segmentation fault)
        raise MlxkvError(
            f"a KV pool of {blocks:,} block{'s' * (blocks != 1)} of {layout.block_size:,} tokens needs "
            f"{need / 2**30:,.1f} GiB, "
            f"more than this machine's {memory / 2**30:,.1f} GiB; lower --num-blocks or --block-size"
        )
    return blocks


def _pool_blocks(cfg: CacheConfig, layout: KVLayout, max_context: int | None, memory: int) -> int:
    if cfg.num_blocks is not None:
        return cfg.num_blocks
    if cfg.memory_budget_bytes is not None:
        blocks = cfg.memory_budget_bytes // layout.bytes_per_block
        if blocks < 1:
            raise MlxkvError(
                f"memory budget of {cfg.memory_budget_bytes} bytes holds no block "
                f"({layout.bytes_per_block} bytes each)"
            )
        return blocks
    share = int(memory * DEFAULT_MEMORY_SHARE) // layout.bytes_per_block
    contexts = MAX_DEFAULT_CONTEXTS * blocks_for(max_context or 8192, layout.block_size)
    return max(1, min(share, contexts))


def _check_messages(messages) -> None:
    """Chat messages as chat templates take them; the templates' own errors
    ("'dict object' has no attribute 'content'") do not say which message."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise MlxkvError("chat messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, m in enumerate(messages, 1):
        if not isinstance(m, dict):
            raise MlxkvError(f"chat message {i} is a {type(m).__name__}, not a dict with 'role' and 'content'")
        for key in ("role", "content"):
            if key not in m:
                raise MlxkvError(f"chat message {i} has no {key!r}")
            if not isinstance(m[key], str):
                raise MlxkvError(f"chat message {i}'s {key!r} must be text, got {type(m[key]).__name__}")
        if "tokens" in m and not is_token_list(m["tokens"]):
            raise MlxkvError(f"chat message {i}'s 'tokens' must be a list of token ids (the reply as generated)")


class Engine:
    def __init__(self, loaded: LoadedModel, cache: CacheConfig):
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.cache_config = cache
        self.layout = probe_kv_layout(loaded, cache.block_size)
        self.fingerprint = model_fingerprint(self.model, loaded.config, self.layout.dtype, cache.block_size)
        self.kv_pool = KVPool(self.layout, size_pool(cache, self.layout, loaded.max_context))
        self.block_pool = BlockPool(self.kv_pool.num_blocks)
        self.connector = build_connector(cache, self.fingerprint, self.layout)
        self.manager = KVCacheManager(self.block_pool, cache.block_size, self.kv_pool, self.connector)
        self.runner = ModelRunner(self.model, self.kv_pool, resolve_attention(cache.attention))
        self._request_ids = itertools.count()
        self.requests_served = 0
        # Sequences being generated, by request id (what a pool view reads).
        self.running: dict[int, Sequence] = {}
        # Prefill chunk, solo and batched alike (same chunks, same numerics).
        self.prefill_chunk = PREFILL_STEP
        self._batch = None

    @classmethod
    def load(cls, model: str, cache: CacheConfig | None = None, **cache_fields) -> Engine:
        """Load `model` (a path, a Hugging Face id, or "demo") onto a new pool."""
        cache = cache or CacheConfig(**cache_fields)
        return cls(load_model(model), cache)

    # -- prompts ----------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "has_chat_template", False))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """The chat's prompt ids; replies that carry their generated ids keep them (reply_tokens.py)."""
        if not self.has_chat_template:
            raise MlxkvError(f"model {self.loaded.name!r} has no chat template; use raw prompts")
        _check_messages(messages)
        return chat_tokens(self.tokenizer, messages, add_generation_prompt)

    def chat_prompt(self, messages: list[dict], max_tokens: int | None = None,
                    fit: bool = False) -> tuple[list[int], int]:
        """The prompt of chat `messages`, and how many messages were left out.

        With `fit`, a chat longer than the context loses its oldest turns
        (context_window.py); otherwise nothing is left out, and the request
        check refuses a prompt that is too long.
        """
        tokens = self.apply_chat_template(messages)
        max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
        if not fit or not whole(max_tokens) or max_tokens < 1:  # a bad option is named by the request check
            return tokens, 0
        limit = self.prompt_limit(max_tokens)
        if len(tokens) <= limit:
            return tokens, 0
        # Each list is templated once: the whole chat is already, and the
        # window that fits is the one measured last. The lists stay in
        # `templated` with their tokens, so no id is reused meanwhile.
        templated = {id(messages): (messages, tokens)}

        def measure(m: list[dict]) -> int:
            if id(m) not in templated:
                templated[id(m)] = (m, self.apply_chat_template(m))
            return len(templated[id(m)][1])

        kept, left_out = fit_messages(messages, limit, measure, count=lambda m: len(self.encode(m["content"])))
        return templated[id(kept)][1], left_out

    def _prompt_tokens(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.encode(prompt) if prompt else []
        return self._check_token_ids(prompt)

    def _check_token_ids(self, prompt) -> list[int]:
        """Token ids as ints, each a row of the embedding table. MLX does not
        bounds-check the embedding lookup: id 5000 in a 1024-token vocabulary
        was a segmentation fault, not an error."""
        if hasattr(prompt, "tolist"):  # an mx.array or numpy array of ids
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)):
            raise MlxkvError("a prompt is text or a list of token ids (whole numbers)")
        vocab = self.loaded.vocab_size
        for t in prompt:
            if not whole(t):  # 2.0 and True are not token ids either
                raise MlxkvError(f"token ids must be whole numbers, got {t!r}")
            if t < 0 or (vocab is not None and t >= vocab):
                size = f" of {vocab} tokens" if vocab is not None else ""
                raise MlxkvError(f"token id {t} is outside the model's vocabulary{size}")
        return [int(t) for t in prompt]

    # -- generation -------------------------------------------------------

    def generate(self, prompt, **kwargs) -> GenerationResult:
        """Generate a whole reply to `prompt` (text or token ids)."""
        tokens, text, last = [], [], None
        prompt_tokens = self._prompt_tokens(prompt)
        for chunk in self.stream(prompt_tokens, **kwargs):
            tokens.append(chunk.token)
            text.append(chunk.text)
            last = chunk
        if last is None or last.finish_reason is None:  # should_stop ended it between tokens
            stats = RequestStats.unknown(len(prompt_tokens), len(tokens))
            return GenerationResult("".join(text), tokens, prompt_tokens, "cancelled", stats)
        return GenerationResult("".join(text), tokens, prompt_tokens, last.finish_reason, last.stats)

    def chat(self, messages: list[dict], **kwargs) -> GenerationResult:
        """Reply to chat messages. For the next turn, append `result.as_message()`
        (the reply with its ids): then the whole of this turn is a prefix hit."""
        return self.generate(self.apply_chat_template(messages), **kwargs)

    def stream_chat(self, messages: list[dict], **kwargs) -> Iterator[GenerationChunk]:
        return self.stream(self.apply_chat_template(messages), **kwargs)

    def stream(self, prompt, should_stop: Callable[[], bool] | None = None, **options) -> Iterator[GenerationChunk]:
        """Yield one `GenerationChunk` per generated token; the last carries stats.

        Options: max_tokens (256), temperature, top_p, top_k, min_p, seed,
        cache_salt. The request runs on the engine's batch loop, so streams
        consumed side by side decode as one batch. `should_stop` is asked
        after each token; when it says yes the reply ends there with
        finish_reason "cancelled" (before the first token: no chunks).
        Closing the generator ends the request and releases its blocks.
        """
        records: deque = deque()
        loop = self.batch_loop()
        request = self.make_request(prompt, records.append, should_stop, **options)
        if not loop.has_work:
            mx.reset_peak_memory()
        loop.add(request)
        try:
            while True:
                while not records:
                    loop.step()
                record = records.popleft()
                if isinstance(record, RequestFailed):
                    if record.finish_reason == "cancelled":
                        return
                    raise MlxkvError(record.message)
                yield record
                if record.finish_reason is not None:
                    return
        finally:
            loop.abort(request)

    # -- many sequences at once (batching.py) -------------------------------

    def generate_batch(self, prompts: list, **options) -> list[GenerationResult]:
        """Whole replies to several prompts, generated as one continuous batch.

        Options as for `stream` (without should_stop). A bad prompt fails
        alone: its result has finish_reason "error" and `extra["error"]`.
        """
        return generate_batch(self, prompts, **options)

    def batch_loop(self):
        """The engine's continuous-batching loop (made on first use)."""
        if self._batch is None:
            self._batch = BatchLoop(self)
        return self._batch

    def make_request(self, prompt, sink, should_stop: Callable[[], bool] | None = None, **options) -> Request:
        """A checked `Request` for the batch loop (options as for `stream`); raises MlxkvError on bad input."""
        prompt_tokens, sampler, root = self._prepare(prompt, **options)
        max_tokens = self.reply_room(len(prompt_tokens), options.get("max_tokens", DEFAULT_MAX_TOKENS))
        return Request(
            next(self._request_ids), prompt_tokens, max_tokens, sampler,
            root, sink, self.tokenizer.detokenizer, should_stop,
        )

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
        prompt_tokens = self._prompt_tokens(prompt)
        sampler = make_request_sampler(temperature, top_p, min_p, top_k, seed)  # checks those options
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise MlxkvError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        self._check_request(prompt_tokens, max_tokens)
        root = root_hash(self.fingerprint, cache_salt) if self.cache_config.prefix_cache else None
        return prompt_tokens, sampler, root

    def reply_room(self, prompt_len: int, max_tokens: int) -> int:
        """The most tokens a reply to a prompt of `prompt_len` tokens gets:
        `max_tokens`, cut where the model's context ends. A reply's last token
        is sampled but never read back, so a prompt that fills the context
        still gets one; past the context a model's positions are untrained."""
        context = self.loaded.max_context
        return max_tokens if context is None else min(max_tokens, context + 1 - prompt_len)

    def prompt_limit(self, max_tokens: int) -> int:
        """The longest prompt a chat is fitted to (`chat_prompt`), leaving
        its reply room for `max_tokens`, in the pool and in the context. A
        reply asked for more than half the context gets the half the prompt
        does not keep."""
        pool = self.kv_pool.num_blocks * self.layout.block_size
        context = self.loaded.max_context
        if context is None:
            return pool - max_tokens
        return min(pool, context + 1) - min(max_tokens, context // 2)

    def _check_request(self, prompt: list[int], max_tokens: int) -> None:
        if not prompt:
            raise MlxkvError("prompt is empty")
        if not whole(max_tokens) or max_tokens < 1:
            raise MlxkvError(f"max_tokens must be a whole number, at least 1, got {max_tokens!r}")
        limit = self.loaded.max_context
        if limit is not None and len(prompt) > limit:
            raise MlxkvError(f"prompt has {len(prompt)} tokens but the model's context is {limit}")
        bs = self.layout.block_size
        reply = self.reply_room(len(prompt), max_tokens)
        need = blocks_for(len(prompt) + reply, bs)
        if need > self.kv_pool.num_blocks:
            raise MlxkvError(
                f"prompt ({len(prompt)} tokens) plus a reply of up to {reply} tokens needs {need} "
                f"blocks of {bs} tokens but the pool has {self.kv_pool.num_blocks}; "
                "raise --num-blocks or lower --max-tokens"
            )

    # -- state ------------------------------------------------------------

    def stats(self) -> dict:
        """Pool state and configuration, as plain data."""
        return {
            "model": self.loaded.name,
            "block_size": self.layout.block_size,
            "kv_bytes_per_block": self.layout.bytes_per_block,
            "pool_bytes": self.kv_pool.nbytes,
            "prefix_cache": self.cache_config.prefix_cache,
            "requests": self.requests_served,
            "pool": self.block_pool.usage(),
            "connector": self.connector.stats(),
        }

    def close(self) -> None:
        """Finish the connector's pending work (e.g. SSD writes)."""
        self.connector.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
