"""`mlxkv bench tiers`: restore or recompute, chosen by measured speeds, on a slow disk.

The SSD tier's reads are throttled to SLOW_DISK bytes/s (a USB stick or a
network share; `DiskKVCacheConnector.read_throttle`, the bench's knob).
Two prefixes are written to the tier; a fresh engine per policy first
serves a cold prompt (its prefill speed) and the first prefix (the tier's
read speed, or, always recomputing, nothing), then the second prefix is
timed. A row per disk speed: the median TTFT with the engine's choice
against the better of the medians of always-restore and always-recompute
(goal: within CHOICE_SLACK), both in the note. The policies take turns
over `rounds` rounds, each round in a rotated order: on this shared
machine one run of each, one after the other, read the same choice as
1.20x of itself.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from mlxkv.benchmarks.engine import _tokens
from mlxkv.benchmarks.rows import row
from mlxkv.cache.restore_cost import AUTO, RECOMPUTE, RESTORE
from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine

CHOICE_TOKENS = 2048
# Bytes/s the SSD tier's reads are slowed to: an SD card or a network share, and a disk so slow
# (a busy spinning one) that recomputing wins even on two CPU cores.
SLOW_DISKS = (25e6, 2e6)
SUFFIX = 16
CHOICE_SLACK = 1.10
CHOICE_ROUNDS = 3
POLICY_ORDER = (AUTO, RESTORE, RECOMPUTE)


def restore_choice_rows(loaded, directory: Path, log, drop_page_cache, tokens: int = CHOICE_TOKENS,
                        rounds: int = CHOICE_ROUNDS) -> list[dict]:
    vocab = loaded.config["vocab_size"]
    first, second = _tokens(tokens, vocab, seed=21), _tokens(tokens, vocab, seed=22)
    config = CacheConfig(block_size=16, num_blocks=4 * (tokens + SUFFIX) // 16 + 8, memory_tier_bytes=0,
                         disk_tier=str(directory))
    log(f"restore or recompute: two {tokens}-token prefixes onto the SSD tier ...")
    with Engine(loaded, config) as setup:
        for prefix in (first, second):
            setup.generate(prefix + _tokens(SUFFIX, vocab, seed=23), max_tokens=1)
    return [_row(loaded, config, directory, first, second, speed, rounds, log, drop_page_cache)
            for speed in SLOW_DISKS]


def _row(loaded, config, directory: Path, first, second, speed: float, rounds: int, log, drop_page_cache) -> dict:
    runs: dict[str, list[float]] = {p: [] for p in POLICY_ORDER}
    chosen: list[str] = []
    for i in range(rounds):
        for policy in POLICY_ORDER[i % 3 :] + POLICY_ORDER[: i % 3]:  # each policy first in turn
            log(f"restore or recompute: round {i + 1}, {policy}, reads throttled to {speed / 1e6:.0f} MB/s ...")
            stats = _timed(loaded, config, directory, first, second, speed, policy, drop_page_cache)
            runs[policy].append(stats.ttft_s)
            if policy == AUTO:
                chosen.append(stats.restore)
    ttft = {p: statistics.median(t) for p, t in runs.items()}
    better = RESTORE if ttft[RESTORE] <= ttft[RECOMPUTE] else RECOMPUTE
    choice = "/".join(sorted(set(chosen)))
    per_round = ", ".join(f"{a / min(r, c):.2f}" for a, r, c in zip(runs[AUTO], runs[RESTORE], runs[RECOMPUTE]))
    return row(f"restore-or-recompute TTFT, SSD at {speed / 1e6:.0f} MB/s", "s", ttft[AUTO], ttft[better],
               f"the better of always restore and always recompute ({better})",
               f"<= {CHOICE_SLACK}", ttft[AUTO] <= CHOICE_SLACK * ttft[better],
               always_restore_s=ttft[RESTORE], always_recompute_s=ttft[RECOMPUTE], chosen=choice, rounds=runs,
               note=f"{len(first)}-token prefix; medians of {rounds} alternated rounds (per round {per_round}); "
                    f"the engine chose {choice!r}; always restore {ttft[RESTORE]:.2f} s, always recompute "
                    f"{ttft[RECOMPUTE]:.2f} s")


def _timed(loaded, config, directory: Path, first, second, speed: float, policy: str, drop_page_cache):
    """The second prefix's request stats, on a fresh engine that first timed a cold prompt and the first."""
    vocab = loaded.config["vocab_size"]
    drop_page_cache(directory.rglob("*.safetensors"))
    with Engine(loaded, config) as engine:
        engine.connector.read_throttle = speed
        engine.coordinator.costs.policy = policy
        engine.generate(_tokens(len(first), vocab, seed=24), max_tokens=1)  # its prefill speed
        engine.generate(first + _tokens(SUFFIX, vocab, seed=25), max_tokens=1)  # the tier's read speed
        return engine.generate(second + _tokens(SUFFIX, vocab, seed=26), max_tokens=1).stats
