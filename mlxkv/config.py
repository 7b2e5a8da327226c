"""Engine configuration: one small frozen dataclass per thing configured, checked at construction.

`PoolConfig`, `TierConfig`, `AttentionConfig`, `SpeculationConfig` and
`CheckpointConfig` compose into the `EngineConfig` an engine core is built
from (engine/core.py). Each default is a constant here, and only here:
the CLI flags (cli_flags.py) and the tiers (connectors/remote/) take theirs
from these.

`CacheConfig` is the flat builder users hand in: `Engine.load(model,
block_size=16, disk_tier=...)`, `CacheConfig(...)` in the Python API, the
CLI's flags. Its fields are the split configs' own under one flat name
each, with their defaults read from them; `engine_config()` makes the EngineConfig, and its construction
checks everything, so a bad field is an MlxkvError where the user hands it
in. It stays flat (and mutable) because that is the one-call API the
README and docs show; the engine reads the split config alone.

This module imports nothing of mlxkv but errors, kv_format and remote_url, the
value types below it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from mlxkv.errors import MlxkvError
from mlxkv.kv_format import KVFormat
from mlxkv.remote_url import check_url

DEFAULT_BLOCK_SIZE = 16
# Share of physical memory the KV pool takes when nothing is said.
DEFAULT_MEMORY_SHARE = 0.25
DEFAULT_KV_GROUP_SIZE = KVFormat().group_size  # the format's own default, named for the flags
# A modest unified-memory tier behind the pool, on unless turned off.
DEFAULT_MEMORY_TIER_BYTES = 256 << 20
# The prefix of every key mlxkv writes on a remote tier's server, and the
# longest a read there waits per socket operation (a slower server is a miss).
DEFAULT_REMOTE_TIER_PREFIX = "mlxkv:"
DEFAULT_REMOTE_TIER_TIMEOUT_MS = 50.0
# Hybrid models: a state checkpoint every prefill chunk's worth of tokens
# (mlx-lm's 2048), so checkpoints never cut a chunk short; prompt and reply
# ends add the ones a chat's next turn resumes from.
DEFAULT_CHECKPOINT_INTERVAL = 2048
# Hybrid models: a real model's state is megabytes per layer, so the
# checkpoints get their own share of the pool's budget.
DEFAULT_CHECKPOINT_SHARE = 0.25
# Hybrid models: a checkpoint a request leaves goes to the SSD tier once the
# KV computed since its chain's last one there outweighs it this many times
# (checkpoints.py): SSD checkpoint bytes stay under half the KV bytes, and a
# restart recomputes at most twice a checkpoint's worth of KV.
DEFAULT_CHECKPOINT_WRITE_RATIO = 2.0
# An engine idle this long writes a hybrid's newest checkpoints to the SSD
# tier (so a restarted chat resumes at its last turn)...
DEFAULT_IDLE_CHECKPOINT_S = 5.0
# ...and this long gives the pool's memory back (cached blocks spill to the tiers).
DEFAULT_IDLE_SHRINK_S = 300.0
# Speculative decoding: the most tokens a row proposes per step (MLX's
# sdpa_vector serves queries of up to 8 tokens: the last one and 7 proposals).
DEFAULT_SPECULATIVE_TOKENS = 4
MAX_SPECULATIVE_TOKENS = 7
SPECULATIVE_MODES = ("lookup", "draft")
ATTENTION_PATHS = ("auto", "reference", "kernel")


def _seconds(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise MlxkvError(f"{name} must be a number of seconds >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """The KV block pool: its blocks, its size, its format, and when it gives memory back."""

    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int | None = None
    memory_budget_bytes: int | None = None
    prefix_cache: bool = True
    kv_format: KVFormat = KVFormat()
    idle_shrink_s: float = DEFAULT_IDLE_SHRINK_S

    def __post_init__(self):
        bs = self.block_size
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1 or bs & (bs - 1):
            raise MlxkvError(f"block size must be a power of two, got {bs!r}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise MlxkvError(f"num_blocks must be at least 1, got {self.num_blocks}")
        if self.memory_budget_bytes is not None and self.memory_budget_bytes <= 0:
            raise MlxkvError(f"memory budget must be positive, got {self.memory_budget_bytes}")
        if not isinstance(self.kv_format, KVFormat):
            raise MlxkvError(f"kv_format must be a KVFormat, got {self.kv_format!r}")
        _seconds("idle_shrink_s", self.idle_shrink_s)


@dataclass(frozen=True, slots=True)
class TierConfig:
    """The tiers behind the pool: memory, SSD, remote (or an explicit connector)."""

    connector: Any = None
    memory_tier_bytes: int = DEFAULT_MEMORY_TIER_BYTES
    memory_tier_bits: int | None = None
    disk_tier: str | None = None
    disk_tier_bytes: int | None = None
    disk_tier_min_free_bytes: int | None = None
    remote_tier: str | None = None
    remote_tier_salt: str | None = None
    remote_tier_prefix: str = DEFAULT_REMOTE_TIER_PREFIX
    remote_tier_ttl_s: int | None = None
    remote_tier_timeout_ms: float = DEFAULT_REMOTE_TIER_TIMEOUT_MS

    def __post_init__(self):
        if self.memory_tier_bytes < 0:
            raise MlxkvError(f"memory tier budget must be >= 0, got {self.memory_tier_bytes}")
        if self.disk_tier_bytes is not None and self.disk_tier_bytes <= 0:
            raise MlxkvError(f"disk tier budget must be positive, got {self.disk_tier_bytes}")
        floor = self.disk_tier_min_free_bytes
        if floor is not None and (not isinstance(floor, int) or floor < 0):
            raise MlxkvError(f"disk tier free-space floor must be a whole number of bytes >= 0, got {floor!r}")
        if self.remote_tier is not None:
            check_url(self.remote_tier)
        if self.remote_tier_salt is not None and not isinstance(self.remote_tier_salt, str):
            raise MlxkvError(f"remote tier salt must be a string, got {type(self.remote_tier_salt).__name__}")
        if not isinstance(self.remote_tier_prefix, str) or any(c.isspace() for c in self.remote_tier_prefix):
            raise MlxkvError(f"remote tier key prefix must be a string without spaces, got {self.remote_tier_prefix!r}")
        ttl = self.remote_tier_ttl_s
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 1):
            raise MlxkvError(f"remote tier TTL must be a whole number of seconds >= 1, got {ttl!r}")
        timeout = self.remote_tier_timeout_ms
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 60_000:
            raise MlxkvError(f"remote tier timeout must be between 0 and 60000 ms, got {timeout!r}")


@dataclass(frozen=True, slots=True)
class AttentionConfig:
    """The attention path: "auto", "reference" or "kernel" (attention/dispatch.py); None: MLXKV_ATTENTION, else auto."""

    path: str | None = None

    def __post_init__(self):
        if self.path not in (None, *ATTENTION_PATHS):
            raise MlxkvError(f"attention must be auto, reference or kernel, got {self.path!r}")


@dataclass(frozen=True, slots=True)
class SpeculationConfig:
    """Speculative decoding: off (mode None), "lookup" or "draft" (with its draft model)."""

    mode: str | None = None
    tokens: int = DEFAULT_SPECULATIVE_TOKENS
    draft_model: str | None = None

    def __post_init__(self):
        if self.mode not in (None, *SPECULATIVE_MODES):
            raise MlxkvError(f"speculative must be lookup or draft, got {self.mode!r}")
        k = self.tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise MlxkvError(f"speculative tokens must be a whole number from 1 to {MAX_SPECULATIVE_TOKENS}, got {k!r}")
        if (self.mode == "draft") != (self.draft_model is not None):
            raise MlxkvError("a draft model goes with speculative decoding by draft: give both or neither "
                             "(--speculative draft --draft-model PATH_OR_ID)")


@dataclass(frozen=True, slots=True)
class CheckpointConfig:
    """A hybrid model's state checkpoints: how often, how much of the budget, when to the SSD tier."""

    interval: int = DEFAULT_CHECKPOINT_INTERVAL
    share: float = DEFAULT_CHECKPOINT_SHARE
    write_ratio: float = DEFAULT_CHECKPOINT_WRITE_RATIO
    idle_s: float = DEFAULT_IDLE_CHECKPOINT_S

    def __post_init__(self):
        if isinstance(self.interval, bool) or not isinstance(self.interval, int) or self.interval < 1:
            raise MlxkvError(f"checkpoint interval must be a whole number of tokens >= 1, got {self.interval!r}")
        if not 0 < self.share < 1:
            raise MlxkvError(f"checkpoint share must be between 0 and 1, got {self.share!r}")
        ratio = self.write_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < float("inf"):
            raise MlxkvError(f"checkpoint write ratio must be a number >= 0, got {ratio!r}")
        _seconds("idle_checkpoint_s", self.idle_s)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything an engine core is built from; the checks that span two parts are here."""

    pool: PoolConfig = PoolConfig()
    tiers: TierConfig = TierConfig()
    attention: AttentionConfig = AttentionConfig()
    speculation: SpeculationConfig = SpeculationConfig()
    checkpoints: CheckpointConfig = CheckpointConfig()

    def __post_init__(self):
        if self.pool.kv_format.quantized and self.tiers.memory_tier_bits is not None:
            raise MlxkvError("--memory-tier-bits quantizes a full-precision pool's blocks; a pool of "
                             "--kv-bits holds them quantized already, and the memory tier keeps them as they are")

    def replace(self, **parts) -> EngineConfig:
        return dataclasses.replace(self, **parts)


def _default(config: type, name: str):
    """The default of field `name` of a split config: the flat builder below has none of its own."""
    return next(f.default for f in dataclasses.fields(config) if f.name == name)


@dataclass(slots=True)
class CacheConfig:
    """The flat builder of an `EngineConfig`: every field of the split configs under one name.

    A facade for the one-call API (`Engine.load(model, disk_tier=...)`, the
    CLI's flags): each field's default is read from the split config it
    builds (`_default`), so a default is defined there alone.

    block_size, num_blocks, memory_budget_bytes, prefix_cache, idle_shrink_s:
        the pool (PoolConfig); num_blocks wins over memory_budget_bytes.
    kv_bits, kv_group_size: the pool stores K and V quantized (8 or 4 bits,
        groups of 64 or 32 along the head dim), and so do the tiers; or give
        `kv_format` (a KVFormat, what the CLI's flags make) instead.
    connector, memory_tier_bytes (0: off), memory_tier_bits, disk_tier (None:
        off), disk_tier_bytes, disk_tier_min_free_bytes, remote_tier (a
        `redis://` or `rediss://` URL), remote_tier_salt, remote_tier_prefix,
        remote_tier_ttl_s, remote_tier_timeout_ms: the tiers (TierConfig;
        docs/tiers.md).
    attention: "auto", "reference" or "kernel" (AttentionConfig).
    checkpoint_interval, checkpoint_share, checkpoint_write_ratio,
        idle_checkpoint_s: a hybrid model's checkpoints (CheckpointConfig).
    speculative (None, "lookup" or "draft"), speculative_tokens, draft_model:
        speculative decoding (SpeculationConfig).
    """

    block_size: int = _default(PoolConfig, "block_size")
    num_blocks: int | None = _default(PoolConfig, "num_blocks")
    memory_budget_bytes: int | None = _default(PoolConfig, "memory_budget_bytes")
    prefix_cache: bool = _default(PoolConfig, "prefix_cache")
    connector: Any = _default(TierConfig, "connector")
    kv_bits: int | None = _default(KVFormat, "bits")
    kv_group_size: int = _default(KVFormat, "group_size")
    kv_format: KVFormat | None = None  # None: kv_bits and kv_group_size say it
    memory_tier_bytes: int = _default(TierConfig, "memory_tier_bytes")
    memory_tier_bits: int | None = _default(TierConfig, "memory_tier_bits")
    disk_tier: str | None = _default(TierConfig, "disk_tier")
    disk_tier_bytes: int | None = _default(TierConfig, "disk_tier_bytes")
    disk_tier_min_free_bytes: int | None = _default(TierConfig, "disk_tier_min_free_bytes")
    remote_tier: str | None = _default(TierConfig, "remote_tier")
    remote_tier_salt: str | None = _default(TierConfig, "remote_tier_salt")
    remote_tier_prefix: str = _default(TierConfig, "remote_tier_prefix")
    remote_tier_ttl_s: int | None = _default(TierConfig, "remote_tier_ttl_s")
    remote_tier_timeout_ms: float = _default(TierConfig, "remote_tier_timeout_ms")
    attention: str | None = _default(AttentionConfig, "path")
    checkpoint_interval: int = _default(CheckpointConfig, "interval")
    checkpoint_share: float = _default(CheckpointConfig, "share")
    checkpoint_write_ratio: float = _default(CheckpointConfig, "write_ratio")
    idle_checkpoint_s: float = _default(CheckpointConfig, "idle_s")
    idle_shrink_s: float = _default(PoolConfig, "idle_shrink_s")
    speculative: str | None = _default(SpeculationConfig, "mode")
    speculative_tokens: int = _default(SpeculationConfig, "tokens")
    draft_model: str | None = _default(SpeculationConfig, "draft_model")

    def __post_init__(self):
        self.engine_config()  # checks every field, where the user hands them in

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            pool=PoolConfig(self.block_size, self.num_blocks, self.memory_budget_bytes, self.prefix_cache,
                            self._kv_format(), self.idle_shrink_s),
            tiers=TierConfig(self.connector, self.memory_tier_bytes, self.memory_tier_bits, self.disk_tier,
                             self.disk_tier_bytes, self.disk_tier_min_free_bytes, self.remote_tier,
                             self.remote_tier_salt, self.remote_tier_prefix, self.remote_tier_ttl_s,
                             self.remote_tier_timeout_ms),
            attention=AttentionConfig(self.attention),
            speculation=SpeculationConfig(self.speculative, self.speculative_tokens, self.draft_model),
            checkpoints=CheckpointConfig(self.checkpoint_interval, self.checkpoint_share,
                                         self.checkpoint_write_ratio, self.idle_checkpoint_s),
        )

    def _kv_format(self) -> KVFormat:
        for name in ("kv_bits", "kv_group_size"):
            if isinstance(getattr(self, name), bool):
                raise MlxkvError(f"{name} must be a number, got {getattr(self, name)!r}")
        if self.kv_format is None:
            return KVFormat(self.kv_bits, self.kv_group_size)
        if (self.kv_bits, self.kv_group_size) != (None, DEFAULT_KV_GROUP_SIZE):
            raise MlxkvError("give kv_format, or kv_bits and kv_group_size, not both")
        return self.kv_format


def engine_config(config: CacheConfig | EngineConfig | None) -> EngineConfig:
    """The EngineConfig of what a caller handed in (None: the defaults)."""
    if config is None:
        return EngineConfig()
    return config if isinstance(config, EngineConfig) else config.engine_config()
