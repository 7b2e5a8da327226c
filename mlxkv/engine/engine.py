"""The Python API: load a model onto a paged KV pool and generate."""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable, Iterator

import mlx.core as mx
from mlx.utils import tree_flatten

from mlxkv.attention.dispatch import choose_attention
from mlxkv.cache.coordinator import KVCacheCoordinator
from mlxkv.cache.fingerprint import model_fingerprint
from mlxkv.cache.hashing import root_hash
from mlxkv.cache.kv_pool import KVPool, with_kv_format
from mlxkv.cache.pool_sizing import checkpoint_budget, initial_blocks, size_pool
from mlxkv.chat import prompting
from mlxkv.config import CacheConfig
from mlxkv.connectors.build import build_connector
from mlxkv.engine.limits import RequestLimits
from mlxkv.engine.loop import BatchLoop
from mlxkv.engine.model_runner import ModelRunner
from mlxkv.engine.records import GenerationChunk, GenerationResult, RequestFailed
from mlxkv.engine.request import Request
from mlxkv.engine.results import collect, failed_result
from mlxkv.engine.sampling import make_request_sampler, whole
from mlxkv.engine.speculation import Speculation
from mlxkv.speculative.draft import DraftProposer, check_same_tokenizer
from mlxkv.speculative.proposer import LookupProposer
from mlxkv.structured.compiler import GrammarCompiler
from mlxkv.errors import MlxkvError, error_line
from mlxkv.system.wired import Device, WiredLimit
from mlxkv.models.loader import LoadedModel, load_model, probe_kv_layout
from mlxkv.vision.image_keys import keyed_root
from mlxkv.vision.images import has_images
from mlxkv.vision.prompt import VisionPrompt, vision_prompt

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256
# Same prefill chunk as mlx-lm's generate_step, so both compute the same
# matmul shapes and greedy output matches token for token.
PREFILL_STEP = 2048
MAX_RUNNING = 64


class Engine:
    """A model on a paged, prefix-cached KV pool, generating for one thread at a time.

    `prefill_chunk` is the most prompt tokens one step computes, solo and
    batched alike (same chunks, same numerics); `max_running` the most
    sequences decoding at once.
    """

    def __init__(self, loaded: LoadedModel, cache: CacheConfig, *,
                 prefill_chunk: int = PREFILL_STEP, max_running: int = MAX_RUNNING, device: Device | None = None):
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.cache_config = cache
        self.draft: Engine | None = None  # the draft model's own engine, under speculative="draft"
        self.kv_layout = with_kv_format(probe_kv_layout(loaded, cache.block_size), cache.kv_format)
        groups, kv = self.kv_layout.group_layout, self.kv_layout.kv
        self.fingerprint = model_fingerprint(self.model, loaded.config, self.kv_layout.dtype, cache.block_size,
                                             None if groups.is_plain else groups.describe(),
                                             self.kv_layout.kv_format if kv.quantized else None)
        budget = size_pool(cache, self.kv_layout, loaded.max_context, device)
        # The pool grows on demand to its budget (block_pool.py): memory as sequences need it.
        self.kv_pool = KVPool(self.kv_layout, initial_blocks(budget))
        self.connector = build_connector(cache, self.fingerprint, self.kv_layout)
        self.cache = KVCacheCoordinator(
            groups, cache.block_size, budget, kv_pool=self.kv_pool, connector=self.connector,
            initial=self.kv_pool.num_blocks, checkpoint_budget=checkpoint_budget(cache, self.kv_layout, budget),
            checkpoint_interval=cache.checkpoint_interval, checkpoint_write_ratio=cache.checkpoint_write_ratio)
        self.block_pool = self.cache.pool
        lay = self.kv_layout
        self.attention = choose_attention(cache.attention, lay.dtype, lay.head_dim, lay.v_head_dim, lay.block_size,
                                          loaded.config.get("num_attention_heads", lay.n_kv_heads), lay.n_kv_heads,
                                          kv_bits=kv.bits, kv_group_size=kv.group_size if kv.quantized else None)
        self.runner = ModelRunner(self.model, self.kv_pool, self.cache, self.attention)
        model_bytes = sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))
        self.loop = BatchLoop(self.cache, self.runner, self.tokenizer.eos_token_ids, prefill_chunk, max_running,
                              WiredLimit(model_bytes, device), self._speculation())
        peak = None if groups.is_plain else (lambda n: self.cache.peak_blocks(n, prefill_chunk))
        self.limits = RequestLimits(loaded.vocab_size, loaded.max_context, budget,
                                    cache.block_size, peak)
        # Grammars compiled for this tokenizer, cached (structured/compiler.py).
        self.structured = GrammarCompiler(self.tokenizer, loaded.vocab_size, self.tokenizer.eos_token_ids)
        self._request_ids = itertools.count()
        self._shrunk_after: int | None = None  # requests served at the last shrink

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
        if has_images(messages):  # the chat app's `/image`: the whole chat, its images keyed by content
            return vision_prompt(self.model, messages), 0
        max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
        if not fit or not whole(max_tokens) or max_tokens < 1:  # a bad option is named by the request check
            return self.apply_chat_template(messages), 0
        limit = self.limits.prompt_limit(max_tokens)
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
        return self.generate(self.apply_chat_template(messages), **kwargs)

    def stream(self, prompt, should_stop: Callable[[], bool] | None = None, **options) -> Iterator[GenerationChunk]:
        """Yield one `GenerationChunk` per generated token; the last carries stats.

        Options: max_tokens (256), temperature, top_p, top_k, min_p, seed,
        cache_salt, speculative (False: this request decodes without
        proposals, when the engine speculates), grammar (a structured.Grammar
        the reply must match: a JSON schema, Lark, a regex). The request runs on the engine's batch loop, so streams
        consumed side by side decode as one batch. `should_stop` is asked
        after each token; when it says yes the reply ends there with
        finish_reason "cancelled" (before the first token: no chunks).
        Closing the generator ends the request and releases its blocks.
        """
        records: deque = deque()
        request = self.make_request(prompt, records.append, should_stop, **options)
        if not self.loop.has_work:
            mx.reset_peak_memory()
        self.loop.add(request)
        try:
            while True:
                while not records:
                    self.loop.step()
                record = records.popleft()
                if isinstance(record, RequestFailed):
                    if record.finish_reason == "cancelled":
                        return
                    raise MlxkvError(record.message)
                yield record
                if record.finish_reason is not None:
                    return
        finally:
            self.loop.abort(request)

    def generate_batch(self, prompts: list, **options) -> list[GenerationResult]:
        """Whole replies to several prompts, generated as one continuous batch.

        Options as for `stream` (without should_stop). A bad prompt fails
        alone: its result has finish_reason "error" and `extra["error"]`.
        """
        records: list[list] = [[] for _ in prompts]
        results: list[GenerationResult | None] = [None] * len(prompts)
        for i, prompt in enumerate(prompts):
            try:
                self.loop.add(self.make_request(prompt, records[i].append, **options))
            except Exception as e:  # a bad prompt fails alone
                results[i] = failed_result(self._tokens_or_none(prompt), error_line(e, log))
        while self.loop.has_work:
            self.loop.step()
        return [result or collect(recs, self.prompt_tokens(prompt))
                for result, recs, prompt in zip(results, records, prompts)]

    def _tokens_or_none(self, prompt) -> list[int]:
        try:
            return self.prompt_tokens(prompt)
        except MlxkvError:
            return []

    def make_request(self, prompt, sink, should_stop: Callable[[], bool] | None = None, speculative: bool = True,
                     grammar=None, **options) -> Request:
        """A checked `Request` for the batch loop (options as for `stream`); raises MlxkvError on bad input."""
        if not isinstance(speculative, bool):
            raise MlxkvError(f"speculative must be true or false, got {speculative!r}")
        prompt_tokens, sampler, root = self._prepare(prompt, **options)
        max_tokens = self.limits.reply_room(len(prompt_tokens), options.get("max_tokens", DEFAULT_MAX_TOKENS))
        images = isinstance(prompt, VisionPrompt)  # its images key the blocks they overlap
        request = Request(
            next(self._request_ids), prompt_tokens, max_tokens, sampler,
            keyed_root(root, prompt.spans, self.cache_config.block_size) if images else root,
            sink, self.tokenizer.detokenizer, should_stop,
            speculative=speculative and self.loop.speculation is not None and not images,
            grammar=None if grammar is None else self.structured.matcher(grammar),
        )
        if images:
            # Made at the row's first forward, on this thread, once its prefix hit is known.
            self.model.rows.attach(request, lambda computed: prompt.row_inputs(self.model, computed))
        return request

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
        root = (root_hash(self.fingerprint, cache_salt, self.cache_config.remote_tier_salt)
                if self.cache_config.prefix_cache else None)
        return prompt_tokens, sampler, root

    # -- state ------------------------------------------------------------

    def stats(self) -> dict:
        """Pool state and configuration, as plain data."""
        return {
            "model": self.loaded.name,
            "block_size": self.kv_layout.block_size,
            "kv_format": self.kv_layout.kv_format,
            "kv_bytes_per_token": self.kv_layout.bytes_per_token,
            "kv_bytes_per_block": self.kv_layout.bytes_per_block,
            "pool_bytes": self.kv_pool.nbytes,
            "pool_budget_bytes": self.block_pool.budget * self.kv_layout.bytes_per_block,
            "prefix_cache": self.cache_config.prefix_cache,
            "requests": self.loop.requests_served,
            "attention": self.attention.as_dict(),
            "pool": self.block_pool.usage(),
            "connector": self.connector.stats(),
            **({"checkpoints": self.checkpoints.stats()} if self.checkpoints is not None else {}),
            "speculative": self._speculation_stats(),
            "structured": self.structured.stats.as_dict(),
            **({"encoder_cache": self.model.encoder_cache.stats()} if hasattr(self.model, "encoder_cache") else {}),
        }

    def _speculation_stats(self) -> dict:
        speculation = self.loop.speculation
        if speculation is None:
            return {"mode": None}
        return {"mode": self.cache_config.speculative, "max_tokens": speculation.max_tokens,
                **speculation.stats.as_dict(), "tok_s_by_batch": speculation.cost.describe()}

    def _speculation(self) -> Speculation | None:
        """The loop's speculative decoding, as configured; none for a hybrid model, whose
        recurrent state cannot be rolled back past rejected tokens (one log line says so)."""
        config = self.cache_config
        if config.speculative is None:
            return None
        if self.cache.recurrent is not None:
            log.warning("speculative decoding is off for this model: its recurrent layers' state cannot be "
                        "rolled back past rejected proposals; it decodes one token at a time")
            return None
        if config.speculative == "lookup":
            return Speculation(LookupProposer(), config.speculative_tokens)
        self.draft = load_draft(config, self)
        return Speculation(DraftProposer(self.draft, self.loaded.vocab_size), config.speculative_tokens)

    def idle(self, seconds: float) -> None:
        """Use a pause: whoever drives the engine (EngineThread) says how long it has had no request.

        After `idle_checkpoint_s` a hybrid's newest checkpoints go to the SSD
        tier; after `idle_shrink_s` the pool gives memory back, once per
        busy spell (cache/block_pool.py's shrink).
        """
        if self.loop.has_work:
            return
        config = self.cache_config
        if seconds >= config.idle_checkpoint_s:
            self.cache.write_pending_checkpoints()
        served = self.loop.requests_served
        if seconds >= config.idle_shrink_s and self._shrunk_after != served:
            self._shrunk_after = served
            before = self.kv_pool.nbytes
            self.cache.shrink()
            log.info("idle: the KV pool gave back %.1f MiB", (before - self.kv_pool.nbytes) / 2**20)

    @property
    def checkpoints(self):
        """A hybrid model's checkpoint store (None for other models)."""
        return self.cache.recurrent.store if self.cache.recurrent is not None else None

    def close(self) -> None:
        """Leave what a restart needs on the SSD tier (a hybrid's newest checkpoints), then
        finish the connector's pending work (its writes)."""
        self.cache.write_pending_checkpoints()
        self.connector.close()
        if self.draft is not None:
            self.draft.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def load_draft(config: CacheConfig, target: Engine) -> Engine:
    """The draft model on an engine of its own: its pool as many blocks as the target's
    (a draft's blocks are smaller), no tiers; it must read tokens as the target does."""
    from mlxkv.models.fetch import fetch_model

    loaded = load_model(fetch_model(config.draft_model, lambda text, fraction=None: None))
    loaded.name = config.draft_model
    draft_config = CacheConfig(block_size=config.block_size, num_blocks=target.block_pool.budget,
                               prefix_cache=config.prefix_cache, memory_tier_bytes=0, attention=config.attention)
    draft = Engine(loaded, draft_config)
    check_same_tokenizer(target, draft)
    if draft.cache.recurrent is not None:
        raise MlxkvError(f"the draft model {config.draft_model!r} has recurrent layers, whose state cannot be "
                         "rolled back past rejected proposals; choose a draft of attention layers only")
    return draft
