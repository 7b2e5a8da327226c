"""A draft model proposes: a smaller model of the same tokenizer, on its own paged cache.

The draft runs on an engine core of its own (its model, pool, coordinator
and runner, its own fingerprint and layout; engine/core.py), driving its
sequences through the core's `sequences` surface, which runs the batch
loop's own step code (engine/run.py). So its prefix is cached as the
target's is: a new turn of a chat catches up from the draft's prefix hit,
not from scratch. For the rows asked, a proposal is k decode steps of the
draft, batched; each row's draft sequence then holds KV for its known
tokens and the proposals it made. Before the next proposal it is brought
back to the tokens the target kept: rolled back to what both agree on and
fed what the target added. A greedy row proposes the draft's argmax; a
sampled one draws from the draft's distribution under the request's own
sampling (and says it, for the rejection rule).

This proposer owns its draft sequences: it alone writes them.
"""

from __future__ import annotations

import logging

import mlx.core as mx

from mlxkv.cache.sequence import Sequence
from mlxkv.errors import MlxkvError, PoolExhaustedError
from mlxkv.speculative.proposer import Proposal
from mlxkv.structured.masks import mask_draft

log = logging.getLogger(__name__)

CATCH_UP_CHUNK = 512  # tokens a draft sequence prefills per forward when it catches up


class DraftProposer:
    def __init__(self, draft, vocab_size: int):
        """`draft`: the draft model's EngineCore (engine/core.py); `vocab_size`: the target's."""
        self.draft = draft
        self.sequences = draft.sequences  # the core's surface for sequences run beside its loop
        self.vocab_size = vocab_size
        self._seqs: dict[object, Sequence] = {}

    def propose(self, requests: list, lengths: list[int]) -> list[Proposal]:
        rows = []
        for request, k in zip(requests, lengths):
            if k > 0 and self._catch_up(request):
                rows.append((request, k))
        made = self._decode(rows) if rows else {}
        return [made.get(request, Proposal([])) for request in requests]

    def forget(self, request) -> None:
        seq = self._seqs.pop(request, None)
        if seq is not None:
            self.sequences.release(seq)

    # -- catching up with the target --------------------------------------------------

    def _catch_up(self, request) -> bool:
        """The request's draft sequence computed up to its last known token; False if the draft's pool is full."""
        seq = self._seqs.get(request)
        tokens = request.tokens
        try:
            if seq is None:
                root = self.draft.derived_root(request.hash_root)  # the salt carries over
                seq = self._seqs[request] = self.sequences.admit(request.request_id, tokens, len(request.prompt),
                                                                 root)
            else:
                self._resync(seq, tokens)
            self.sequences.prefill(seq, len(tokens) - 1, CATCH_UP_CHUNK)
            return True
        except PoolExhaustedError:
            log.debug("the draft model's pool is full: no proposal this step")
            self.forget(request)
            return False

    def _resync(self, seq: Sequence, tokens: list[int]) -> None:
        """Make the draft sequence's tokens the target's, keeping the KV both agree on."""
        agree = len(seq.prompt)
        known = seq.prompt + seq.output
        while agree < min(len(known), len(tokens)) and known[agree] == tokens[agree]:
            agree += 1
        seq.output[:] = tokens[len(seq.prompt):]
        if seq.num_computed > agree:
            self.sequences.rollback(seq, max(agree, seq.num_cached_blocks * self.sequences.block_size))

    # -- proposing -------------------------------------------------------------------

    def _decode(self, rows: list) -> dict:
        """k_max batched draft steps; each row proposes its first k tokens."""
        made = {request: Proposal([], []) for request, _ in rows}
        last = {request: request.last_token for request, _ in rows}
        for step in range(max(k for _, k in rows)):
            live = [request for request, k in rows if k > step]
            seqs = [self._seqs[r] for r in live]
            try:
                for seq in seqs:
                    self.sequences.allocate(seq, 1)
            except PoolExhaustedError:
                break  # what was proposed so far stands
            logprobs = self.sequences.decode(seqs, [last[r] for r in live])
            for i, (request, seq) in enumerate(zip(live, seqs)):
                last[request] = self._pick(request, logprobs[i], made[request])
                seq.output.append(last[request])  # the draft's own guess, corrected at the next catch-up
        return {r: Proposal(p.tokens, mx.stack(p.probs) if p.probs and not r.sampler.greedy else None)
                for r, p in made.items()}

    def _pick(self, request, logprobs: mx.array, proposal: Proposal) -> int:
        logprobs = _to_vocab(logprobs, self.vocab_size)
        if request.grammar is not None:  # a constrained row drafts within its grammar
            logprobs = mask_draft(request, logprobs, proposal.tokens)
        if request.sampler.greedy:
            token = int(mx.argmax(logprobs).item())
        else:
            scores = request.sampler.scores(logprobs)
            proposal.probs.append(mx.softmax(scores, axis=-1))
            token = int(request.sampler.categorical(scores).item())
        proposal.tokens.append(token)
        return token


def _to_vocab(logprobs: mx.array, vocab_size: int) -> mx.array:
    """The draft's logprobs over the target's vocabulary (embedding tables are padded differently)."""
    n = logprobs.shape[-1]
    if n > vocab_size:
        return logprobs[..., :vocab_size]
    if n < vocab_size:
        return mx.concatenate([logprobs, mx.full((*logprobs.shape[:-1], vocab_size - n), -mx.inf, logprobs.dtype)], -1)
    return logprobs


def check_same_tokenizer(target, draft) -> None:
    """A draft proposes token ids: both must read them the same, or the target rejects them all.
    `target`, `draft`: the loaded models (models/loader.py's LoadedModel)."""
    sample = "Hello, world! def f(x):\n    return x + 1  # 2026"
    if target.tokenizer.encode(sample) != draft.tokenizer.encode(sample) or (
            target.tokenizer.eos_token_ids != draft.tokenizer.eos_token_ids):
        raise MlxkvError(f"the draft model {draft.name!r} does not share the tokenizer of "
                         f"{target.name!r}; speculative decoding needs the same tokenizer")
