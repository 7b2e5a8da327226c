"""What a quantized pool costs in quality: perplexity and greedy agreement, teacher-forced.

Both feed the same tokens to the model over a pool of each format (the
engine's own `PagedKVCache` and attention, one block table per row), so the
formats differ only in what the pool stores:

- perplexity of real English text, computed in chunks of CHUNK tokens
  (every chunk attends over the quantized pages of all before it, and its
  own): the text is the Python reference manual's prose, which ships with
  CPython (`pydoc_data.topics`), so it is on every machine, offline;
- greedy agreement: prompts are prefilled, then the full-precision pool's
  greedy reply is fed a token at a time (decode steps: the quantized
  matmul path); a position agrees when the pool's argmax there is the
  reply's next token. Free-running replies part for good at their first
  near-tie, so they measure where that happens, not the format.
"""

from __future__ import annotations

import math

import mlx.core as mx

from mlxkv.attention.dispatch import route_model_attention
from mlxkv.attention.paged_cache import PagedBatch, PagedKVCache
from mlxkv.cache.groups.base import blocks_for
from mlxkv.cache.kv_format import KVFormat
from mlxkv.cache.kv_pool import KVPool, with_kv_format
from mlxkv.errors import MlxkvError
from mlxkv.models.loader import probe_kv_layout

BLOCK = 16
CHUNK = 512
TEXT_TOPICS = ("execmodel", "naming", "exceptions", "import", "assignment", "compound", "types")


def reference_text() -> str:
    """Prose of the Python language reference, as CPython ships it (pydoc_data)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in TEXT_TOPICS if name in topics)


class ForcedRows:
    """Rows of given tokens through the model over a pool of format `kv`, at their own offsets."""

    def __init__(self, loaded, kv: KVFormat, rows: int, max_tokens: int):
        layout = with_kv_format(probe_kv_layout(loaded, BLOCK), kv)
        if not layout.group_layout.is_plain:
            raise MlxkvError("the quality rows run models of one full-attention group")
        self.model, self.layers = loaded.model, layout.num_layers
        per_row = blocks_for(max_tokens, BLOCK)
        self.pool = KVPool(layout, rows * per_row)
        self.tables = [list(range(r * per_row, (r + 1) * per_row)) for r in range(rows)]
        self.offsets = [0] * rows
        route_model_attention(self.model)

    def step(self, tokens: list[list[int]], rows: list[int] | None = None) -> mx.array:
        """Logits `[B, L, vocab]` of the next L tokens of `rows` (all by default), one list each."""
        rows = list(range(len(self.tables))) if rows is None else rows
        n = len(tokens[0])
        offsets = [self.offsets[r] for r in rows]
        tables = [self.tables[r][: blocks_for(o + n, BLOCK)] for r, o in zip(rows, offsets)]
        batch = PagedBatch.build(tables, offsets, n, BLOCK)
        caches = [PagedKVCache(self.pool, layer, batch, index=None) for layer in range(self.layers)]
        logits = self.model(mx.array(tokens), cache=caches).astype(mx.float32)
        mx.eval(logits, self.pool.arrays)
        for r in rows:
            self.offsets[r] += n
        return logits


def perplexity(loaded, kv: KVFormat, tokens: list[int]) -> float:
    """exp of the mean negative log-likelihood of `tokens[1:]`, in chunks of CHUNK."""
    run = ForcedRows(loaded, kv, 1, len(tokens))
    nll, count = 0.0, 0
    for start in range(0, len(tokens) - 1, CHUNK):
        chunk = tokens[start : start + CHUNK + 1]
        logits = run.step([chunk[:-1]])[0]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        picked = mx.take_along_axis(logprobs, mx.array(chunk[1:])[:, None], axis=-1)
        nll -= picked.sum().item()
        count += len(chunk) - 1
    return math.exp(nll / count)


def greedy_agreement(loaded, kv: KVFormat, prompts: list[list[int]], replies: list[list[int]]) -> tuple[int, int]:
    """(positions that agree, positions) of the replies, each row fed its prompt and then its
    reply a token at a time: a position agrees when the argmax over a pool of `kv` is the
    reply's token there."""
    run = ForcedRows(loaded, kv, len(prompts), max(len(p) + len(r) for p, r in zip(prompts, replies)))
    last = {i: run.step([p], [i])[0, -1] for i, p in enumerate(prompts)}
    agree = total = 0
    for i in range(max(map(len, replies))):
        rows = [r for r in last if i < len(replies[r])]
        picked = mx.argmax(mx.stack([last[r] for r in rows]), axis=-1).tolist()
        agree += sum(int(t == replies[r][i]) for t, r in zip(picked, rows))
        total += len(rows)
        going = [r for r in rows if i + 1 < len(replies[r])]
        if going:
            logits = run.step([[replies[r][i]] for r in going], going)[:, -1]
            last = dict(zip(going, logits))
    return agree, total
