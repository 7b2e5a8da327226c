"""The server's counters in Prometheus' text format (GET /metrics).

Hand-written rather than prometheus_client: a few counters and two
histograms, rendered in one function, with no process-wide registry (two
servers in one process, as in the tests, keep their own).
"""

from __future__ import annotations

import threading
from collections import defaultdict

from mlxkv.connectors.health import STATES
from mlxkv.engine.records import RequestStats

# Seconds. TTFT spans a cached turn (milliseconds) to a cold long prompt (minutes).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.n += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{_number(b)}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        out.append(f'{name}_bucket{{le="+Inf"}} {self.n}')
        return out + [f"{name}_sum {_number(self.total)}", f"{name}_count {self.n}"]


class ServerMetrics:
    """What the server counted since it started; thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = defaultdict(int)  # (endpoint, status) -> count
        self.cancelled = 0  # requests whose client left before the reply ended
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cached_tokens: dict[str, int] = defaultdict(int)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)

    def request_done(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, str(status))] += 1

    def request_cancelled(self) -> None:
        with self._lock:
            self.cancelled += 1

    def reply_done(self, stats: RequestStats) -> None:
        with self._lock:
            self.prompt_tokens += stats.prompt_tokens
            self.generation_tokens += stats.generation_tokens
            for tier, n in stats.cached_tokens.items():
                self.cached_tokens[tier] += n
            if stats.generation_tokens:
                self.ttft.observe(stats.ttft_s)
            if stats.generation_tokens > 1 and stats.decode_tokens_per_s > 0:
                self.tpot.observe(1.0 / stats.decode_tokens_per_s)

    def render(self, open_requests: int, pool: dict | None, speculative: dict | None = None,
               tiers: dict | None = None, structured: dict | None = None,
               encoder: dict | None = None, distributed: dict | None = None) -> str:
        """The text exposition; `pool`: BlockPool.usage(), or None before the model is ready;
        `speculative`: Engine.stats()'s speculative decoding counters; `tiers`: the connector's
        stats per tier; `structured`: the grammar compiler's stats (structured/compiler.py);
        `distributed`: a distributed set's (LockstepCore.stats()), with every rank's report."""
        with self._lock:
            lines = _metric("mlxkv_requests_total", "counter", "HTTP requests by endpoint and status",
                            [f'{{endpoint="{e}",status="{s}"}} {n}' for (e, s), n in sorted(self.requests.items())])
            lines += _metric("mlxkv_requests_cancelled_total", "counter", "requests whose client left first",
                             [f" {self.cancelled}"])
            lines += _metric("mlxkv_prompt_tokens_total", "counter", "prompt tokens of finished replies",
                             [f" {self.prompt_tokens}"])
            lines += _metric("mlxkv_generation_tokens_total", "counter", "generated tokens", [f" {self.generation_tokens}"])
            lines += _metric("mlxkv_cached_tokens_total", "counter", "prompt tokens reused, by tier",
                             [f'{{tier="{t}"}} {n}' for t, n in sorted(self.cached_tokens.items())])
            lines += _metric("mlxkv_time_to_first_token_seconds", "histogram", "time to first token", [])
            lines += self.ttft.lines("mlxkv_time_to_first_token_seconds")
            lines += _metric("mlxkv_time_per_output_token_seconds", "histogram", "decode time per token", [])
            lines += self.tpot.lines("mlxkv_time_per_output_token_seconds")
        lines += _metric("mlxkv_open_requests", "gauge", "requests queued or running", [f" {open_requests}"])
        if pool is not None:
            lines += _metric("mlxkv_pool_blocks", "gauge", "KV pool blocks by state",
                             [f'{{state="{k}"}} {pool[k]}' for k in ("in_use", "cached_free", "free", "size_blocks",
                                                                     "budget_blocks") if k in pool])
            lines += _metric("mlxkv_pool_evictions_total", "counter", "cached blocks evicted from the pool",
                             [f" {pool.get('evictions', 0)}"])
        if speculative and speculative.get("mode"):
            lines += _speculation_lines(speculative)
        if tiers:
            lines += tier_lines(tiers)
        if structured:
            lines += _structured_lines(structured)
        if encoder:  # a vision model's encoder-output cache (vision/encoder_cache.py)
            lines += _encoder_lines(encoder)
        if distributed:
            lines += distributed_lines(distributed)
        return "\n".join(lines) + "\n"


def _structured_lines(stats: dict) -> list[str]:
    """Structured output: compile-cache hits and compile time, and the token masks' time per step."""
    lines = []
    for key, name, help_text in (("compile_cache_hits", "compile_cache_hits", "grammars found compiled"),
                                 ("compile_cache_misses", "compiles", "grammars compiled"),
                                 ("mask_steps", "mask_steps", "steps that masked constrained rows")):
        lines += _metric(f"mlxkv_structured_{name}_total", "counter", help_text, [f" {stats.get(key, 0)}"])
    lines += _metric("mlxkv_structured_compile_seconds_total", "counter", "time spent compiling grammars",
                     [f" {_number(stats.get('compile_s', 0.0))}"])
    steps = stats.get("mask_steps", 0)
    lines += _metric("mlxkv_structured_mask_seconds_per_step", "gauge",
                     "mean time a step spent computing and applying token masks",
                     [f" {_number(stats.get('mask_s', 0.0) / steps if steps else 0.0)}"])
    return lines


def _encoder_lines(stats: dict) -> list[str]:
    lines = []
    for key, help_text in (("hits", "images whose vision tower output came from the encoder cache"),
                           ("misses", "images the vision tower encoded")):
        lines += _metric(f"mlxkv_encoder_cache_{key}_total", "counter", help_text, [f" {stats.get(key, 0)}"])
    for key, help_text in (("image_tokens", "image tokens in prompts"),
                           ("cached_image_tokens", "image tokens a prefix hit served from the KV cache")):
        lines += _metric(f"mlxkv_{key}_total", "counter", help_text, [f" {stats.get(key, 0)}"])
    return lines + _metric("mlxkv_encoder_cache_bytes", "gauge", "bytes of vision tower output kept",
                           [f" {stats.get('bytes', 0)}"])


def _speculation_lines(stats: dict) -> list[str]:
    lines = []
    for key, help_text in (("proposed", "tokens proposed by speculative decoding"),
                           ("accepted", "proposed tokens the model accepted"),
                           ("steps", "speculative verify steps")):
        lines += _metric(f"mlxkv_speculative_{key}_total", "counter", help_text, [f" {stats.get(key, 0)}"])
    lines += _metric("mlxkv_speculative_acceptance_rate", "gauge", "accepted / proposed",
                     [f" {_number(stats.get('acceptance_rate', 0.0))}"])
    lines += _metric("mlxkv_speculative_tokens_per_step", "gauge", "tokens a proposing row produced per step",
                     [f" {_number(stats.get('tokens_per_step', 0.0))}"])
    return lines


# Per tier: the counters of its stats() (TierStats and the health counts) that a dashboard plots.
TIER_COUNTERS = {
    "hit_blocks": "blocks a lookup found in the tier",
    "hydrations": "blocks (and checkpoints) read back from the tier",
    "stores": "blocks (and checkpoints) written to the tier",
    "spills": "blocks the pool (or the tier in front) pushed into the tier",
    "dropped_writes": "writes the tier dropped (queue full, down, refused)",
    "write_errors": "writes that failed",
    "corrupt": "blocks that failed verification on a read",
}


def tier_lines(tiers: dict) -> list[str]:
    """Each tier's state (1 for the one it is in, see connectors/health.py), bytes and counters."""
    names = sorted(tiers)
    lines = _metric("mlxkv_tier_state", "gauge", "the state each tier is in (1) and is not in (0)",
                    [f'{{tier="{t}",state="{state}"}} {int(tiers[t].get("state") == state)}'
                     for t in names for state in STATES])
    lines += _metric("mlxkv_tier_bytes", "gauge", "bytes the tier holds",
                     [f'{{tier="{t}"}} {tiers[t].get("bytes_held", 0)}' for t in names])
    for key, help_text in TIER_COUNTERS.items():
        lines += _metric(f"mlxkv_tier_{key}_total", "counter", help_text,
                         [f'{{tier="{t}"}} {tiers[t].get(key, 0)}' for t in names])
    return lines


# Per rank, from its last report (distributed/rank_report.py): seconds spent, by what in.
RANK_SECONDS = {
    "step_s": ("mlxkv_rank_step_seconds_total", "time in the engine's steps (the model's collectives included)"),
    "plan_s": ("mlxkv_rank_plan_seconds_total", "time in the step plan's collectives, waiting included"),
    "plan_wait_s": ("mlxkv_rank_plan_wait_seconds_total", "of which waiting for a slower rank to reach them"),
}


def distributed_lines(stats: dict) -> list[str]:
    """The set's size and state, and each rank's steps, collective time, pool blocks and tier bytes."""
    ranks = stats.get("per_rank", [])
    lines = _metric("mlxkv_distributed_ranks", "gauge", "ranks in the set", [f" {stats['ranks']}"])
    lines += _metric("mlxkv_distributed_lost", "gauge", "1 once the set lost a rank and stopped",
                     [f" {int(stats.get('lost') is not None)}"])
    lines += _metric("mlxkv_rank_steps_total", "counter", "steps each rank ran",
                     [f'{{rank="{r["rank"]}"}} {r.get("steps", 0)}' for r in ranks])
    for key, (name, help_text) in RANK_SECONDS.items():
        lines += _metric(name, "counter", help_text, [f'{{rank="{r["rank"]}"}} {_number(r.get(key, 0))}' for r in ranks])
    lines += _metric("mlxkv_rank_pool_blocks", "gauge", "each rank's KV pool blocks by state",
                     [f'{{rank="{r["rank"]}",state="{k}"}} {n}' for r in ranks for k, n in r.get("pool", {}).items()])
    lines += _metric("mlxkv_rank_tier_bytes", "gauge", "bytes each rank's tiers hold",
                     [f'{{rank="{r["rank"]}",tier="{t}"}} {s.get("bytes_held", 0)}'
                      for r in ranks for t, s in r.get("tiers", {}).items()])
    return lines


def _metric(name: str, kind: str, help_text: str, samples: list[str]) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *(name + s for s in samples)]


def _number(x: float) -> str:
    return repr(float(x)) if x != int(x) else str(int(x)) if abs(x) < 1e15 else repr(float(x))
