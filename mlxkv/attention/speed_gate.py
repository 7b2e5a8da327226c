"""The speed gate: `auto` decodes on the kernels only where they are faster.

No Mac has timed the kernels for us, and where they lose to the reference
path (SDPA, as mlx-lm runs it) a Mac user would decode slower than with
mlx-lm. So on Metal, once the kernels passed their self-check, `auto` times
one step's attention on the model's own shape both ways, in buckets of
query tokens per row (1: decode; 4: a speculative verify step, which runs
another kernel), batch (1, 8) and context (512, 4k, 16k), about
GATE_BUDGET_S in all, under the conditions the engine decodes in:

- a step is several layers, each over its own K/V and each layer's output
  the next one's queries, evaluated once (`Trial.step`), and steps are
  pipelined as the engine pipelines them (the next built while the last
  runs: `_per_call`), so the per-call Python and command-buffer costs are
  hidden as they are in the engine rather than timed per layer;
- the layers hold at least WORKING_SET_BYTES of K/V (more than any Apple
  chip's system-level cache), and the rows of a batch their own blocks, so
  reads come from memory as they do at that context;
- a warm-up call of each before the timed rounds.

The two paths:

- kernel: the paged kernels, straight from the pool;
- reference: what the engine runs instead. At batch 1 that is SDPA over a
  contiguous copy (the engine's mirror, mlx-lm's own cache); at larger
  batches the gather of the rows' blocks, then SDPA with a length mask
  (and, for several queries, the causal rule among them). Over a
  quantized pool both run the quantized matmuls (quantized.py) over the
  quantized pages, as the engine does.

A step then goes to the bucket of its kind (one query, or several: the
nearest query count on a log scale), nearest its batch and longest context
(on a log scale), and takes the path timed faster there: the kernels only
when they win by MARGIN, so a near tie stays on the reference path. The
choice is stored per model shape, KV format, chip and MLX version
(gate_store.py), so a restart neither re-times it nor flips it. The timer
is a parameter: `alternate` measures, tests pass canned timings.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import mlx.core as mx
import numpy as np

from mlxkv.attention import kernels
from mlxkv.attention.paged_cache import PagedBatch, PagedKVCache
from mlxkv.attention.quantized import quantized_attention
from mlxkv.cache.kv_format import FULL, KVFormat, parts_of
from mlxkv.cache.kv_pool import KVLayout, KVPool

GATE_QUERIES = (1, 4)  # decode; a verify step of 3 proposals, adaptive k's middle
GATE_BATCHES = (1, 8)
GATE_CONTEXTS = (512, 4096, 16384)
GATE_BUDGET_S = 1.2  # all buckets, both paths; once per shape, chip and MLX version (stored)
ROUNDS = 3
MARGIN = 0.03  # the kernels must be this much faster than the reference path to be used
WORKING_SET_BYTES = 128 << 20  # K/V a timed step reads at least: over any Apple chip's system-level cache
MAX_LAYERS = 64  # layers a timed step runs at most (short contexts)


@dataclass(frozen=True)
class AttentionShape:
    """What the kernels are instantiated for: a model's attention, one layer."""

    dtype: mx.Dtype
    head_dim: int
    block_size: int
    n_heads: int
    n_kv_heads: int
    kv: KVFormat = FULL  # the pool's format


@dataclass(frozen=True)
class Bucket:
    """One (batch, context, queries) bucket: milliseconds per step each way, and the path it takes."""

    batch: int
    context: int
    kernel_ms: float
    reference_ms: float
    queries: int = 1  # new tokens per row

    @property
    def path(self) -> str:
        return "kernel" if self.kernel_ms < self.reference_ms * (1 - MARGIN) else "reference"

    def as_dict(self) -> dict:
        return {**asdict(self), "path": self.path}


@dataclass(frozen=True)
class SpeedGate:
    buckets: tuple[Bucket, ...]
    source: str = "measured"  # where the choice came from: timed at this load, or stored (gate_store.py)

    def path_for(self, batch: int, context: int, queries: int = 1) -> str:
        """The path of the bucket nearest (log scale) to `batch` rows of `queries` new tokens, the
        longest of `context` tokens. One query and several run different kernels: a step of
        several goes to the nearest bucket of several, if the gate timed any."""
        counts = {x.queries for x in self.buckets}
        kind = {n for n in counts if (n > 1) == (queries > 1)} or counts
        q = _nearest(kind, queries)
        b = _nearest({x.batch for x in self.buckets}, batch)
        c = _nearest({x.context for x in self.buckets}, context)
        return next(x.path for x in self.buckets if (x.batch, x.context, x.queries) == (b, c, q))

    def as_list(self) -> list[dict]:
        return [b.as_dict() for b in self.buckets]


def _nearest(values: set[int], x: int) -> int:
    return min(sorted(values), key=lambda v: abs(math.log(max(x, 1) / v)))


@dataclass(frozen=True)
class Trial:
    """One side of a bucket's timing: a step to call, and what to evaluate first."""

    path: str  # "kernel" or "reference"
    batch: int
    context: int
    step: Callable[[], mx.array]
    inputs: tuple[mx.array, ...] = ()
    queries: int = 1


def measure(shape: AttentionShape, run=None, timer=None, batches=GATE_BATCHES, contexts=GATE_CONTEXTS,
            budget_s: float = GATE_BUDGET_S, queries=GATE_QUERIES,
            working_set_bytes: int = WORKING_SET_BYTES) -> SpeedGate:
    """Time both paths in every bucket. `run`: what runs a kernel launch (the GPU);
    `timer(kernel, reference, budget_s)`: seconds per step of each Trial, `budget_s` spent
    on each (`time_trials`); `working_set_bytes`: K/V a step reads at least (`layers_for`)."""
    timer = timer or time_trials
    per_trial = budget_s / (2 * len(queries) * len(batches) * len(contexts))
    rng = np.random.default_rng(0)
    buckets = []
    for n_queries in queries:
        for batch in batches:
            for context in contexts:
                case = DecodeCase(shape, context, batch, rng, queries=n_queries,
                                  layers=layers_for(shape, context, batch, working_set_bytes))
                reference = Trial("reference", batch, context,
                                  case.contiguous if batch == 1 else case.paged("reference"),
                                  case.inputs(contiguous=batch == 1), n_queries)
                kernel = Trial("kernel", batch, context, case.paged("kernel", run), case.inputs(), n_queries)
                kernel_s, reference_s = timer(kernel, reference, per_trial)
                buckets.append(Bucket(batch, context, kernel_s * 1e3, reference_s * 1e3, n_queries))
                del case, kernel, reference  # one bucket's arrays at a time
    return SpeedGate(tuple(buckets))


def layers_for(shape: AttentionShape, context: int, batch: int, working_set_bytes: int = WORKING_SET_BYTES) -> int:
    """Layers a timed step runs: enough for `working_set_bytes` of K/V, at most MAX_LAYERS."""
    layout = KVLayout(1, shape.n_kv_heads, shape.head_dim, shape.head_dim, shape.block_size, shape.dtype,
                      kv=shape.kv)
    per_layer = layout.bytes_per_token * context * batch
    return max(1, min(MAX_LAYERS, -(-working_set_bytes // per_layer)))


def time_trials(a: Trial, b: Trial, budget_s: float, clock=time.perf_counter) -> tuple[float, float]:
    """Seconds per step of a and b, inputs evaluated first."""
    mx.eval(*a.inputs, *b.inputs)
    return alternate(a.step, b.step, budget_s, clock)


def alternate(a, b, budget_s: float, clock=time.perf_counter) -> tuple[float, float]:
    """Median seconds per call of a() and b(), rounds alternated (AB BA AB), `budget_s` each."""
    mx.eval(a())
    mx.eval(b())  # warm-up: kernels compiled, buffers allocated
    times = {a: [], b: []}
    for r in range(ROUNDS):
        for fn in ((a, b) if r % 2 == 0 else (b, a)):
            times[fn].append(_per_call(fn, budget_s / ROUNDS, clock))
    return statistics.median(times[a]), statistics.median(times[b])


def _per_call(fn, budget_s: float, clock) -> float:
    """Seconds per step of fn(), pipelined as the engine decodes: each step is submitted, then
    the previous one waited for, so building one overlaps running the other."""
    calls, start, pending = 0, clock(), None
    while True:
        out = fn()
        mx.async_eval(out)
        if pending is not None:
            mx.eval(pending)
        pending = out
        calls += 1
        if clock() - start >= budget_s:
            mx.eval(pending)
            return (clock() - start) / calls


class DecodeCase:
    """One step's attention over `layers` layers: `batch` rows of `context` tokens in a pool, the
    last `queries` of each new, through shuffled block tables, each layer's output the next
    layer's queries (`distinct=False`: every row reads the same blocks, in its own order, so
    the pool holds one row's worth; tests only)."""

    def __init__(self, shape: AttentionShape, context: int, batch: int, rng, distinct: bool = True,
                 queries: int = 1, layers: int = 1):
        per_row = -(-context // shape.block_size)
        n_blocks = per_row * (batch if distinct else 1)
        self.kv = shape.kv
        layout = KVLayout(layers, shape.n_kv_heads, shape.head_dim, shape.head_dim, shape.block_size, shape.dtype,
                          kv=shape.kv)
        blocks = (n_blocks, shape.n_kv_heads, shape.block_size, shape.head_dim)

        def random_pages():
            x = mx.random.normal(blocks, dtype=shape.dtype)
            return self.kv.page(x)

        keys, values = [random_pages() for _ in range(layers)], [random_pages() for _ in range(layers)]
        self.pool = KVPool(layout, n_blocks, pages=(keys, values))
        order = rng.permutation(n_blocks) if distinct else None
        tables = [[int(x) for x in (order[i * per_row:(i + 1) * per_row] if distinct else rng.permutation(per_row))]
                  for i in range(batch)]
        self.paged_batch = PagedBatch.build(tables, [context - queries] * batch, queries, shape.block_size,
                                            "reference")
        self.queries = mx.random.normal((batch, shape.n_heads, queries, shape.head_dim), dtype=shape.dtype)
        self.scale = shape.head_dim ** -0.5
        self.context, self.batch, self.layers = context, batch, layers
        # The rows' K/V laid out contiguously (a lone row's: the engine's mirror), per layer; lazy,
        # so only a side that reads them evaluates them.
        length = context if batch == 1 else None
        self.contiguous_kv = [self._gathered(layer, self.paged_batch.block_tables, length) for layer in range(layers)]

    def _gathered(self, layer: int, tables, length: int | None):
        """The rows' K/V as the engine's reference path reads them (a quantized pool's parts)."""
        if self.kv.quantized:
            return self.pool.gather_quantized(layer, tables, length)
        k, v = self.pool.gather(layer, tables)
        return (k, v) if length is None else (mx.contiguous(k[:, :, :length]), mx.contiguous(v[:, :, :length]))

    def inputs(self, contiguous: bool = False) -> tuple[mx.array, ...]:
        pools = [page for layer in range(self.layers) for page in (self.pool.keys[layer], self.pool.values[layer])]
        gathered = [part for kv in self.contiguous_kv for x in kv for part in parts_of(x)] if contiguous else []
        return (*pools, self.queries, *gathered)

    def _layers(self, attend):
        """A step: attend(layer, queries) through every layer, each output the next queries."""
        def step():
            q = self.queries
            for layer in range(self.layers):
                q = attend(layer, q)
            return q

        return step

    def paged(self, path: str, run=None):
        """The engine's step attention on `path`: the kernels read the pool; the reference
        path gathers the rows' blocks (update_and_fetch) and runs SDPA with a length mask."""
        from mlxkv.attention.dispatch import paged_attention  # dispatch imports this module

        if path == "kernel":
            tables, lens = self.paged_batch.groups[0].kernel_tables, [self.context] * self.batch
            return self._layers(lambda layer, q: kernels.paged_decode(
                q, self.pool.keys[layer], self.pool.values[layer], tables, lens, self.scale, run=run))
        cache = PagedKVCache(self.pool, 0, self.paged_batch)
        mask = cache.make_mask(self.queries.shape[2])
        length = self.context if self.batch == 1 else None

        def reference(layer, q):
            keys, values = self._gathered(layer, cache.tables.block_tables, length)
            if self.kv.quantized:
                return quantized_attention(q, keys, values, self.scale, mask, self.kv.bits, self.kv.group_size)
            return paged_attention(q, keys, values, cache, self.scale, mask)

        return self._layers(reference)

    def contiguous(self) -> mx.array:
        """A step of SDPA over the same K/V laid out contiguously, as mlx-lm's cache (and the engine's
        mirror of a lone sequence) holds them; several queries under the causal rule."""
        mask = "causal" if self.queries.shape[2] > 1 else None

        def attend(layer, q):
            keys, values = self.contiguous_kv[layer]
            if self.kv.quantized:
                return quantized_attention(q, keys, values, self.scale, mask, self.kv.bits, self.kv.group_size)
            return mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)

        return self._layers(attend)()
