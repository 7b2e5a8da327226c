"""Sequences driven a forward at a time, beside the batch loop: what a draft model runs.

A draft proposer (speculative/draft.py) keeps one sequence per target
request on its own core and moves it itself: admitted from the tokens
known so far (prefix hits included), prefilled up to a point, decoded a
token at a time in batches, rolled back to what the target kept, released.
Every forward goes through run.py's `prefill_chunk` and `forward_rows`, the
batch loop's own step code. The caller owns the sequences' tokens (it
alone writes `seq.output`); this class owns their blocks.
"""

from __future__ import annotations

import mlx.core as mx

from mlxkv.cache.coordinator import KVCacheCoordinator
from mlxkv.cache.hashing import BlockHash
from mlxkv.cache.sequence import Sequence
from mlxkv.engine.model_runner import ModelRunner
from mlxkv.engine.run import forward_rows, prefill_chunk


class Sequences:
    def __init__(self, coordinator: KVCacheCoordinator, runner: ModelRunner):
        self._cache, self._runner = coordinator, runner

    @property
    def block_size(self) -> int:
        return self._cache.block_size

    def admit(self, seq_id: int, tokens: list[int], prompt_len: int, root: BlockHash | None) -> Sequence:
        """A sequence of `tokens`, its first `prompt_len` its prompt, starting on its prefix hit."""
        prompt = tokens[:prompt_len]
        seq = self._cache.admit(seq_id, prompt, root, self._cache.lookup(prompt, root))
        seq.output.extend(tokens[prompt_len:])
        return seq

    def prefill(self, seq: Sequence, upto: int, chunk: int) -> None:
        """Compute `seq`'s known tokens up to `upto`, `chunk` per forward, registering full blocks.
        PoolExhaustedError when the pool has no room."""
        tokens = None
        while seq.num_computed < upto:
            tokens = tokens or seq.prompt + seq.output
            n = min(chunk, upto - seq.num_computed)
            self._cache.allocate_slots(seq, n)
            prefill_chunk(self._runner, self._cache, seq, tokens[seq.num_computed : seq.num_computed + n])
            self._cache.register_computed(seq)

    def allocate(self, seq: Sequence, num_new: int) -> None:
        """Room for `num_new` more tokens of `seq`; PoolExhaustedError when the pool has none."""
        self._cache.allocate_slots(seq, num_new)

    def decode(self, seqs: list[Sequence], tokens: list[int]) -> mx.array:
        """One batched forward of each sequence's next token (room allocated); logprobs `[B, vocab]`."""
        return forward_rows(self._runner, self._cache, seqs, mx.array([[t] for t in tokens]))

    def rollback(self, seq: Sequence, num_computed: int) -> None:
        """Forget `seq`'s KV past `num_computed` tokens."""
        self._cache.rollback(seq, num_computed)

    def release(self, seq: Sequence) -> None:
        self._cache.release(seq)
        self._runner.release(seq)
