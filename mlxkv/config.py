"""Cache configuration, checked where the user hands it in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlxkv.errors import MlxkvError

# Share of physical memory the KV pool takes when nothing is said.
DEFAULT_MEMORY_SHARE = 0.25
# A modest unified-memory tier behind the pool, on unless turned off.
DEFAULT_MEMORY_TIER_BYTES = 256 << 20
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


@dataclass(slots=True)
class CacheConfig:
    """How the KV block pool is sized and used.

    block_size: tokens per block, a power of two.
    num_blocks: pool size in blocks; wins over memory_budget_bytes.
    memory_budget_bytes: pool size as a byte budget for K and V of all layers.
    prefix_cache: share blocks by content hash across requests.
    connector: a KVCacheConnector; when None, one is built from the tier fields.
    memory_tier_bytes: budget of the unified-memory tier (0 turns it off).
    kv_bits: None (K/V in the model's dtype), 8 or 4: the pool stores K and V
        quantized (mx.quantize's affine groups along the head dim), and so
        do the tiers, as they are (cache/kv_format.py).
    kv_group_size: values per scale and bias of a quantized pool, 64 or 32.
    memory_tier_bits: store memory-tier blocks 8-bit (or 4-bit) quantized
        (a full-precision pool's; a quantized pool's blocks stay as they are).
    disk_tier: directory of the SSD tier; None (the Python API default) turns it off.
    disk_tier_bytes: budget of the SSD tier (None: the tier's default).
    disk_tier_min_free_bytes: free space the SSD tier leaves on its disk,
        deleting its least recently used files to keep it (None: 5% of the
        disk, at most 1 GiB).
    remote_tier: URL of a Redis or Valkey server shared by many processes
        (`redis://[user:password@]host:port/db`, `rediss://` for TLS);
        None turns the remote tier off.
    remote_tier_salt: a secret that goes into the root of every block
        chain, so only engines holding it share blocks (docs/tiers.md).
    remote_tier_prefix: the prefix of every key mlxkv writes on the server.
    remote_tier_ttl_s: keys expire this long after they are written (None: never).
    remote_tier_timeout_ms: the longest a read from the server waits per
        socket operation; a slower server is a miss, and marked down.
    attention: "auto", "reference" or "kernel" (attention/dispatch.py); None:
        MLXKV_ATTENTION, else "auto".
    checkpoint_interval: for models with recurrent layers, tokens between
        the state checkpoints a long prefill leaves (whole blocks); prompts
        and replies also leave one at their last full block.
    checkpoint_share: the share of the pool's byte budget that holds those
        checkpoints; the KV blocks get the rest.
    checkpoint_write_ratio: a checkpoint a request leaves is written to the
        SSD tier once the KV computed since the last one there is this many
        times its bytes; 0 writes every one (fastest restarts, most bytes).
        The newest one of each chat not written goes there anyway on a clean
        close, or once the engine has been idle `idle_checkpoint_s`.
    idle_shrink_s: once the engine has been idle this long, the pool keeps
        about what its last busy spell used and gives the rest of its
        memory back (its other cached blocks spill to the tiers).
    speculative: None (off), "lookup" (prompt lookup: proposals copied from
        what followed the newest tokens earlier in the prompt and reply) or
        "draft" (a smaller draft model of the same tokenizer proposes).
    speculative_tokens: the most tokens a decoding row proposes per step.
    draft_model: the draft model (a path or Hugging Face id) for "draft".
    """

    block_size: int = 16
    num_blocks: int | None = None
    memory_budget_bytes: int | None = None
    prefix_cache: bool = True
    connector: Any = None
    kv_bits: int | None = None
    kv_group_size: int = 64
    memory_tier_bytes: int = DEFAULT_MEMORY_TIER_BYTES
    memory_tier_bits: int | None = None
    disk_tier: str | None = None
    disk_tier_bytes: int | None = None
    disk_tier_min_free_bytes: int | None = None
    remote_tier: str | None = None
    remote_tier_salt: str | None = None
    remote_tier_prefix: str = "mlxkv:"
    remote_tier_ttl_s: int | None = None
    remote_tier_timeout_ms: float = 50.0
    attention: str | None = None
    checkpoint_interval: int = DEFAULT_CHECKPOINT_INTERVAL
    checkpoint_share: float = DEFAULT_CHECKPOINT_SHARE
    checkpoint_write_ratio: float = DEFAULT_CHECKPOINT_WRITE_RATIO
    idle_checkpoint_s: float = DEFAULT_IDLE_CHECKPOINT_S
    idle_shrink_s: float = DEFAULT_IDLE_SHRINK_S
    speculative: str | None = None
    speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS
    draft_model: str | None = None

    def __post_init__(self):
        bs = self.block_size
        if not isinstance(bs, int) or bs < 1 or bs & (bs - 1):
            raise MlxkvError(f"block size must be a power of two, got {bs!r}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise MlxkvError(f"num_blocks must be at least 1, got {self.num_blocks}")
        budget = self.memory_budget_bytes
        if budget is not None and budget <= 0:
            raise MlxkvError(f"memory budget must be positive, got {budget}")
        if self.memory_tier_bytes < 0:
            raise MlxkvError(f"memory tier budget must be >= 0, got {self.memory_tier_bytes}")
        if self.disk_tier_bytes is not None and self.disk_tier_bytes <= 0:
            raise MlxkvError(f"disk tier budget must be positive, got {self.disk_tier_bytes}")
        self._check_kv_format()
        self._check_tiers()
        if not isinstance(self.checkpoint_interval, int) or self.checkpoint_interval < 1:
            raise MlxkvError(f"checkpoint interval must be a whole number of tokens >= 1, got {self.checkpoint_interval!r}")
        if not 0 < self.checkpoint_share < 1:
            raise MlxkvError(f"checkpoint share must be between 0 and 1, got {self.checkpoint_share!r}")
        ratio = self.checkpoint_write_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < float("inf"):
            raise MlxkvError(f"checkpoint write ratio must be a number >= 0, got {ratio!r}")
        for name in ("idle_checkpoint_s", "idle_shrink_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise MlxkvError(f"{name} must be a number of seconds >= 0, got {value!r}")
        self._check_speculation()
        if self.attention not in (None, "auto", "reference", "kernel"):
            raise MlxkvError(
                f"attention must be auto, reference or kernel, got {self.attention!r}"
            )

    def _check_kv_format(self) -> None:
        from mlxkv.cache.kv_format import KVFormat

        for name in ("kv_bits", "kv_group_size"):
            if isinstance(getattr(self, name), bool):
                raise MlxkvError(f"{name} must be a number, got {getattr(self, name)!r}")
        KVFormat(self.kv_bits, self.kv_group_size)  # checks both
        if self.kv_bits is not None and self.memory_tier_bits is not None:
            raise MlxkvError("--memory-tier-bits quantizes a full-precision pool's blocks; a pool of "
                             "--kv-bits holds them quantized already, and the memory tier keeps them as they are")

    @property
    def kv_format(self):
        """How the pool stores K/V (cache/kv_format.py)."""
        from mlxkv.cache.kv_format import KVFormat

        return KVFormat(self.kv_bits, self.kv_group_size)

    def _check_tiers(self) -> None:
        floor = self.disk_tier_min_free_bytes
        if floor is not None and (not isinstance(floor, int) or floor < 0):
            raise MlxkvError(f"disk tier free-space floor must be a whole number of bytes >= 0, got {floor!r}")
        if self.remote_tier is not None:
            from mlxkv.connectors.remote.url import check_url

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

    def _check_speculation(self) -> None:
        if self.speculative not in (None, *SPECULATIVE_MODES):
            raise MlxkvError(f"speculative must be lookup or draft, got {self.speculative!r}")
        k = self.speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise MlxkvError(f"speculative tokens must be a whole number from 1 to {MAX_SPECULATIVE_TOKENS}, got {k!r}")
        if (self.speculative == "draft") != (self.draft_model is not None):
            raise MlxkvError("a draft model goes with speculative decoding by draft: give both or neither "
                             "(--speculative draft --draft-model PATH_OR_ID)")
