"""`mlxkv bench tiers`: restore or recompute, chosen by measured speeds, on a slow disk.

The SSD tier's reads are throttled to SLOW_DISK bytes/s (a USB stick or a
network share; `DiskKVCacheConnector.read_throttle`, the bench's knob).
Two prefixes are written to the tier; a fresh engine per policy first
serves a cold prompt (its prefill speed) and the first prefix (the tier's
read speed, or, always recomputing, nothing), then the second prefix is
timed. Rows: TTFT with the engine's choice against always-restore and
always-recompute (goal: within CHOICE_SLACK of the better of the two).
"""

from __future__ import annotations

from pathlib import Path

from mlxkv.benchmarks.engine import _tokens
from mlxkv.benchmarks.rows import row
from mlxkv.cache.restore_cost import AUTO, RECOMPUTE, RESTORE
from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine

CHOICE_TOKENS = 2048
SLOW_DISK = 25e6  # bytes/s
SUFFIX = 16
CHOICE_SLACK = 1.10


def restore_choice_rows(loaded, directory: Path, log, drop_page_cache, tokens: int = CHOICE_TOKENS) -> list[dict]:
    vocab = loaded.config["vocab_size"]
    first, second = _tokens(tokens, vocab, seed=21), _tokens(tokens, vocab, seed=22)
    config = CacheConfig(block_size=16, num_blocks=4 * (tokens + SUFFIX) // 16 + 8, memory_tier_bytes=0,
                         disk_tier=str(directory))
    log(f"restore or recompute: two {tokens}-token prefixes onto the SSD tier ...")
    with Engine(loaded, config) as setup:
        for prefix in (first, second):
            setup.generate(prefix + _tokens(SUFFIX, vocab, seed=23), max_tokens=1)
    ttft, chosen = {}, {}
    for policy in (AUTO, RESTORE, RECOMPUTE):
        log(f"restore or recompute: {policy}, reads throttled to {SLOW_DISK / 1e6:.0f} MB/s ...")
        drop_page_cache(directory.rglob("*.safetensors"))
        with Engine(loaded, config) as engine:
            engine.connector.read_throttle = SLOW_DISK
            engine.coordinator.costs.policy = policy
            engine.generate(_tokens(tokens, vocab, seed=24), max_tokens=1)  # its prefill speed
            engine.generate(first + _tokens(SUFFIX, vocab, seed=25), max_tokens=1)  # the tier's read speed
            stats = engine.generate(second + _tokens(SUFFIX, vocab, seed=26), max_tokens=1).stats
        ttft[policy], chosen[policy] = stats.ttft_s, stats.restore
    best = min(ttft[RESTORE], ttft[RECOMPUTE])
    better = RESTORE if ttft[RESTORE] <= ttft[RECOMPUTE] else RECOMPUTE
    note = (f"{tokens}-token prefix on an SSD tier read at {SLOW_DISK / 1e6:.0f} MB/s; the engine chose "
            f"{chosen[AUTO]!r}, the faster was {better}")
    return [
        row("restore-or-recompute TTFT vs always restore", "s", ttft[AUTO], ttft[RESTORE], "always restore",
            f"<= {CHOICE_SLACK} of the better", ttft[AUTO] <= CHOICE_SLACK * best, note=note),
        row("restore-or-recompute TTFT vs always recompute", "s", ttft[AUTO], ttft[RECOMPUTE], "always recompute",
            f"<= {CHOICE_SLACK} of the better", ttft[AUTO] <= CHOICE_SLACK * best, note=note),
    ]
