"""The engine core: one model on one paged pool, behind one small surface.

`build_core` wires the parts (KV pool, cache coordinator, connector,
model runner, batch loop, speculation) from a loaded model and a config;
`EngineCore` is all its callers see of them:

- requests: `add`, `step` (returns the requests that finished), `abort`,
  `has_work`, `requests_served`;
- state: `stats()`, and a pool snapshot source for host/pool_view.py
  (`block_pool`, `running_tables()`, `tier_stats()`);
- pauses and the end: `idle(seconds)`, `close()`;
- `sequences`: sequences driven a forward at a time with the loop's own
  step code (engine/sequences.py), what a draft model's proposer runs.
- a rank of a distributed set (distributed/lockstep.py): `decisions()`,
  what the next step would decide by this process's clock, and `follow(...)`
  rank 0's instead; `step_failure`, and `fail_all(message)` when the set is lost.

The Python API (engine.py), the engine thread (host/), the server and the
draft proposer (speculative/) use this surface alone; the target model, a
draft model and the host all load through `load_named` (models/loader.py).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Protocol

from mlx.utils import tree_flatten

from mlxkv.attention.dispatch import AttentionChoice, choose_attention
from mlxkv.cache.block_pool import BlockPool
from mlxkv.cache.coordinator import KVCacheCoordinator
from mlxkv.cache.fingerprint import model_fingerprint
from mlxkv.cache.hashing import BlockHash, root_hash
from mlxkv.cache.kv_pool import KVLayout, KVPool, with_kv_format
from mlxkv.cache.pool_sizing import checkpoint_budget, initial_blocks, size_pool
from mlxkv.cache.restore_cost import RESTORE
from mlxkv.config import EngineConfig, PoolConfig, TierConfig
from mlxkv.connectors.build import build_connector
from mlxkv.engine.limits import RequestLimits
from mlxkv.engine.loop import BatchLoop
from mlxkv.engine.model_runner import ModelRunner
from mlxkv.engine.request import Request
from mlxkv.engine.sequences import Sequences
from mlxkv.structured.compiler import GrammarCompiler
from mlxkv.engine.speculation import Speculation
from mlxkv.errors import MlxkvError
from mlxkv.models.loader import LoadedModel, load_named, probe_kv_layout
from mlxkv.speculative.draft import DraftProposer, check_same_tokenizer
from mlxkv.speculative.proposer import LookupProposer
from mlxkv.system.wired import Device, WiredLimit

log = logging.getLogger(__name__)

# Same prefill chunk as mlx-lm's generate_step, so both compute the same
# matmul shapes and greedy output matches token for token.
PREFILL_STEP = 2048
MAX_RUNNING = 64


class EngineCore:
    """The parts of one model's engine; see the module docstring for its surface.

    `coordinator`, `runner`, `loop`, `kv_pool` and `connector` are the core's
    own: read them in tests and benchmarks, never from host/, server/,
    speculative/ or tui/ (tests/test_layout.py checks the imports).
    """

    def __init__(self, loaded: LoadedModel, config: EngineConfig, *, kv_layout: KVLayout, fingerprint: bytes,
                 kv_pool: KVPool, connector, coordinator: KVCacheCoordinator, attention: AttentionChoice,
                 runner: ModelRunner, loop: BatchLoop, limits: RequestLimits, draft: EngineCore | None = None):
        self.loaded, self.config = loaded, config
        self.tokenizer = loaded.tokenizer
        self.kv_layout, self.fingerprint, self.limits = kv_layout, fingerprint, limits
        self.kv_pool, self.connector, self.coordinator = kv_pool, connector, coordinator
        self.attention, self.runner, self.loop = attention, runner, loop
        self.draft = draft  # the draft model's own core, under speculative="draft"
        self.sequences = Sequences(coordinator, runner)
        # Grammars compiled for this tokenizer, cached (structured/compiler.py): a request's
        # matcher comes from here, so agents' repeated tools compile once per model.
        self.structured = GrammarCompiler(self.tokenizer, loaded.vocab_size, self.tokenizer.eos_token_ids)
        self._shrunk_after: int | None = None  # requests served at the last shrink

    # -- requests ---------------------------------------------------------

    def add(self, request: Request) -> None:
        self.loop.add(request)

    def step(self) -> list[Request]:
        """One step of the batch; the requests that finished in it."""
        return self.loop.step()

    def abort(self, request: Request) -> None:
        self.loop.abort(request)

    @property
    def step_failure(self) -> str | None:
        """Why the last step failed, its requests ended; None if it did not fail."""
        return self.loop.step_failure

    def fail_all(self, message: str) -> list[Request]:
        """End every request with `message` (the set of ranks this core ran on is gone)."""
        return self.loop.fail_all(message)

    def decisions(self) -> dict:
        """What the next step decides by this process's clock (the step-cost guard's choice
        per batch size), as plain data: rank 0's go to every rank of a distributed set."""
        speculation = self.loop.speculation
        return {"speculate": speculation.cost.choices()} if speculation is not None else {}

    def follow(self, decisions: dict) -> None:
        """Decide the next step as `decisions` (another core's, rank 0's) say, not by this clock."""
        if self.loop.speculation is not None:
            self.loop.speculation.cost.follow({int(k): v for k, v in decisions.get("speculate", {}).items()})

    @property
    def has_work(self) -> bool:
        return self.loop.has_work

    @property
    def requests_served(self) -> int:
        return self.loop.requests_served

    @property
    def speculates(self) -> bool:
        return self.loop.speculation is not None

    def hash_root(self, cache_salt: str | None = None) -> BlockHash | None:
        """The root of a request's block chain; None when the prefix cache is off."""
        if not self.config.pool.prefix_cache:
            return None
        return root_hash(self.fingerprint, cache_salt, self.config.tiers.remote_tier_salt)

    def derived_root(self, root: BlockHash | None) -> BlockHash | None:
        """The root this core's chains take for a request of another core (a draft's of its
        target's), so a salt carries over."""
        if root is None:
            return None
        return hashlib.sha256(b"mlxkv-draft\0" + self.fingerprint + root).digest()

    # -- state --------------------------------------------------------------

    @property
    def block_pool(self) -> BlockPool:
        return self.coordinator.pool

    @property
    def hybrid(self) -> bool:
        """The model has recurrent layers (their state is checkpointed, not paged)."""
        return self.coordinator.recurrent is not None

    @property
    def checkpoints(self):
        """A hybrid model's checkpoint store (None for other models)."""
        recurrent = self.coordinator.recurrent
        return recurrent.store if recurrent is not None else None

    def running_tables(self) -> list[tuple[dict, list]]:
        """Each running sequence's cached tokens by source and its first group's block table."""
        return [(seq.cached_tokens, self.coordinator.tables(seq)[0]) for seq in self.loop.running.values()]

    def tier_stats(self) -> dict:
        return self.connector.stats()

    def stats(self) -> dict:
        """Pool state and configuration, as plain data."""
        lay, pool = self.kv_layout, self.block_pool
        return {
            "model": self.loaded.name,
            "block_size": lay.block_size,
            "kv_format": lay.kv_format,
            "kv_bytes_per_token": lay.bytes_per_token,
            "kv_bytes_per_block": lay.bytes_per_block,
            "pool_bytes": self.kv_pool.nbytes,
            "pool_budget_bytes": pool.budget * lay.bytes_per_block,
            "prefix_cache": self.config.pool.prefix_cache,
            "requests": self.requests_served,
            "attention": self.attention.as_dict(),
            "pool": pool.usage(),
            "connector": self.connector.stats(),
            "restore_cost": self.coordinator.costs.as_dict(),  # the restore-or-recompute estimates
            **({"checkpoints": self.checkpoints.stats()} if self.checkpoints is not None else {}),
            "speculative": self._speculation_stats(),
            "structured": self.structured.stats.as_dict(),
            **({"encoder_cache": self.loaded.model.encoder_cache.stats()}
               if hasattr(self.loaded.model, "encoder_cache") else {}),
        }

    def _speculation_stats(self) -> dict:
        speculation = self.loop.speculation
        if speculation is None:
            return {"mode": None}
        return {"mode": self.config.speculation.mode, "max_tokens": speculation.max_tokens,
                **speculation.stats.as_dict(), "tok_s_by_batch": speculation.cost.describe()}

    # -- pauses and the end ---------------------------------------------------

    def idle(self, seconds: float) -> None:
        """Use a pause: whoever drives the core says how long it has had no request.

        After `idle_checkpoint_s` a hybrid's newest checkpoints, and those at
        its branch points, go to the SSD tier; after `idle_shrink_s` the pool
        gives memory back, once per busy spell (cache/block_pool.py's shrink).
        """
        if self.has_work:
            return
        if seconds >= self.config.checkpoints.idle_s:
            self._write_pending_checkpoints()
        served = self.requests_served
        if seconds >= self.config.pool.idle_shrink_s and self._shrunk_after != served:
            self._shrunk_after = served
            before = self.kv_pool.nbytes
            pool = self.block_pool
            pool.shrink(keep_cached=pool.peak_in_use)  # about what the last busy spell used
            self.coordinator.writes.drain()  # what the shrink evicted, to the tiers
            log.info("idle: the KV pool gave back %.1f MiB", (before - self.kv_pool.nbytes) / 2**20)

    def close(self) -> None:
        """Leave what a restart needs on the SSD tier (a hybrid's newest checkpoints and
        those at its branch points), then finish the connector's pending work (its writes)."""
        self._write_pending_checkpoints()
        self.coordinator.writes.drain()
        self.coordinator.loads.close()
        self.connector.close()
        if self.draft is not None:
            self.draft.close()


    def _write_pending_checkpoints(self) -> None:
        """A hybrid's newest checkpoint of each chain, and each branch point's, not on disk
        yet go there (close, idle, and so a model's unload)."""
        if self.coordinator.recurrent is not None:
            self.coordinator.recurrent.write_pending()


class Lockstep(Protocol):
    """What a rank of a distributed set (distributed/lockstep.py) agrees with the others while
    its core is built and run: every rank then decides the same from the same inputs."""

    def identity(self, fingerprint: bytes) -> tuple[bytes, bytes]:
        """This rank's shard `fingerprint` -> the set's block identity, and this shard's tier key."""

    def agree(self, n: int) -> list[int]:
        """Every rank's `n`, in rank order."""


def build_core(loaded: LoadedModel, config: EngineConfig, *, prefill_chunk: int = PREFILL_STEP,
               max_running: int = MAX_RUNNING, device: Device | None = None,
               lockstep: Lockstep | None = None) -> EngineCore:
    """The one way an engine core is built: `loaded` on a new pool sized and tiered by `config`;
    `lockstep`: as one rank of a distributed set, whose ranks must take every decision alike."""
    pool = config.pool
    layout = with_kv_format(probe_kv_layout(loaded, pool.block_size), pool.kv_format)
    groups, kv = layout.group_layout, layout.kv
    fingerprint = model_fingerprint(loaded.model, loaded.config, layout.dtype, pool.block_size,
                                    None if groups.is_plain else groups.describe(),
                                    layout.kv_format if kv.quantized else None)
    tier_key = fingerprint
    budget = size_pool(config, layout, loaded.max_context, device)
    if lockstep is not None:  # one block identity for the set; the smallest pool of any rank
        fingerprint, tier_key = lockstep.identity(fingerprint)
        budget = min(lockstep.agree(budget))
    # The pool grows on demand to its budget (block_pool.py): memory as sequences need it.
    kv_pool = KVPool(layout, initial_blocks(budget))
    connector = build_connector(config.tiers, tier_key, layout)
    checkpoints = config.checkpoints
    coordinator = KVCacheCoordinator(
        groups, pool.block_size, budget, kv_pool=kv_pool, connector=connector,
        initial=kv_pool.num_blocks, checkpoint_budget=checkpoint_budget(config, layout, budget),
        checkpoint_interval=checkpoints.interval, checkpoint_write_ratio=checkpoints.write_ratio,
        agree=lockstep.agree if lockstep is not None else None)
    if lockstep is not None:
        coordinator.costs.policy = RESTORE  # restore-or-recompute by measured speeds: a per-rank clock
    attention = choose_attention(config.attention.path, layout.dtype, layout.head_dim, layout.v_head_dim,
                                 layout.block_size, loaded.config.get("num_attention_heads", layout.n_kv_heads),
                                 layout.n_kv_heads, kv=kv)
    runner = ModelRunner(loaded.model, kv_pool, coordinator, attention)
    speculation, draft = _speculation(config, loaded, coordinator, budget)
    model_bytes = sum(v.nbytes for _, v in tree_flatten(loaded.model.parameters()))
    loop = BatchLoop(coordinator, runner, loaded.tokenizer.eos_token_ids, prefill_chunk, max_running,
                     WiredLimit(model_bytes, device), speculation, background_loads=lockstep is None)
    peak = None if groups.is_plain else (lambda n: coordinator.peak_blocks(n, prefill_chunk))
    limits = RequestLimits(loaded.vocab_size, loaded.max_context, budget, pool.block_size, peak)
    return EngineCore(loaded, config, kv_layout=layout, fingerprint=fingerprint, kv_pool=kv_pool,
                      connector=connector, coordinator=coordinator, attention=attention, runner=runner,
                      loop=loop, limits=limits, draft=draft)


def _speculation(config: EngineConfig, loaded: LoadedModel, coordinator: KVCacheCoordinator,
                 budget: int) -> tuple[Speculation | None, EngineCore | None]:
    """The loop's speculative decoding as configured, and the draft model's core if it has one;
    none for a hybrid model, whose recurrent state cannot be rolled back past rejected
    tokens (one log line says so)."""
    speculative = config.speculation
    if speculative.mode is None:
        return None, None
    if coordinator.recurrent is not None:
        log.warning("speculative decoding is off for this model: its recurrent layers' state cannot be "
                    "rolled back past rejected proposals; it decodes one token at a time")
        return None, None
    if speculative.mode == "lookup":
        return Speculation(LookupProposer(), speculative.tokens), None
    draft = load_draft(config, loaded, budget)
    return Speculation(DraftProposer(draft, loaded.vocab_size), speculative.tokens), draft


def load_draft(config: EngineConfig, target: LoadedModel, target_blocks: int) -> EngineCore:
    """The draft model on a core of its own: its pool as many blocks as the target's
    (a draft's blocks are smaller), no tiers; it must read tokens as the target does."""
    name = config.speculation.draft_model
    loaded = load_named(name)
    pool = PoolConfig(config.pool.block_size, num_blocks=target_blocks, prefix_cache=config.pool.prefix_cache)
    draft = build_core(loaded, EngineConfig(pool=pool, tiers=TierConfig(memory_tier_bytes=0),
                                            attention=config.attention))
    check_same_tokenizer(target, draft.loaded)
    if draft.coordinator.recurrent is not None:
        raise MlxkvError(f"the draft model {name!r} has recurrent layers, whose state cannot be "
                         "rolled back past rejected proposals; choose a draft of attention layers only")
    return draft
