"""The step's token masks: computed for every constrained row at once, applied to the logits.

Called by the engine's run (engine/run.py) only when some row of the step
has a grammar: a batch without one pays nothing. A decode step's masks are
computed on the compiler's worker thread while the engine thread starts the
forward (`async_eval`), so llguidance works while the model runs, on either
back-end (on the CPU `async_eval` itself runs most of the step before it
returns); reading a row's in-flight token waits only for the previous step. llguidance fills a bitmask (a bit per token, 32 to an
int32) for all rows in one call; its MLX kernel is Metal-only, so the mask
is applied here with plain MLX ops (unpack the bits, `where`), which run
on every back-end.

A row whose grammar is complete (or that failed) may only end: its mask
allows the tokenizer's EOS ids alone.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import mlx.core as mx
import numpy as np

log = logging.getLogger(__name__)

def constrained(requests) -> bool:
    return any(r.grammar is not None for r in requests)


def mask_decode(requests, inputs: mx.array | None, logits: mx.array) -> mx.array:
    """`logits [B, vocab]` of a decode step with each constrained row's disallowed tokens at -inf.

    `inputs [B, 1]` are the rows' last tokens (lazy while the previous step is in flight):
    a row whose newest token is not in its output yet consumes it from there."""
    rows = [(i, r) for i, r in enumerate(requests) if r.grammar is not None]
    compiler = rows[0][1].grammar.compiler
    pending = any(r.issued > r.num_output for _, r in rows) and inputs is not None
    last = inputs[:, 0] if pending else None
    if last is not None:
        mx.async_eval(last)  # scheduled here, so the worker only waits for it
    # The masks on the compiler's worker while this thread starts the forward: on the CPU
    # back-end `async_eval` returns only when most of the step has run, and a mask computed
    # after it left the cores idle for its time, every step of a lone constrained stream.
    masks = compiler.worker.submit(_decode_masks, rows, len(requests), last)
    mx.async_eval(logits)
    bitmask, start = masks.result()
    masked = apply_bitmask(logits, bitmask)
    _record(compiler, rows, bitmask, start, 1)
    return masked


def _decode_masks(rows, batch: int, last: mx.array | None) -> tuple[np.ndarray, float]:
    """The rows' bitmask, each matcher first caught up with its reply and its in-flight token
    (`last [B]`, scheduled: reading it waits for the previous step); and when the masks'
    own time began. No MLX work but that read: it runs on the compiler's worker thread."""
    last = last.tolist() if last is not None else None
    start = time.perf_counter()  # the masks' own time, from here
    for i, r in rows:
        r.grammar.catch_up(r, [last[i]] if last is not None and r.issued > r.num_output else [])
    compiler = rows[0][1].grammar.compiler
    bitmask = np.full((batch, _words(compiler.vocab_size)), -1, dtype=np.int32)
    _fill(compiler, [(r.grammar, i, None) for i, r in rows], bitmask)
    return bitmask, start


def mask_verify(requests, proposals: dict, logits: mx.array) -> mx.array:
    """`logits [B, L, vocab]` of a verify step, masked at each position: position j of a row
    as its grammar stands after the row's first j proposed tokens (cut to valid ones)."""
    rows = [(i, r) for i, r in enumerate(requests) if r.grammar is not None]
    mx.async_eval(logits)
    start = time.perf_counter()
    batch, length = logits.shape[0], logits.shape[1]
    for _, r in rows:
        r.grammar.catch_up(r)
    compiler = rows[0][1].grammar.compiler
    bitmask = np.full((batch * length, _words(compiler.vocab_size)), -1, dtype=np.int32)
    items = []
    for i, r in rows:
        proposal = proposals.get(r)
        items.append((r.grammar, i * length, list(proposal.tokens) if proposal and proposal.tokens else None))
    _fill(compiler, items, bitmask)
    masked = apply_bitmask(logits.reshape(batch * length, -1), bitmask).reshape(logits.shape)
    _record(compiler, rows, bitmask, start, length)
    return masked


def cut_proposals(proposals: dict) -> dict:
    """Each constrained row's proposal cut at its first token the grammar refuses (the rest
    could never be accepted, and a masked verify needs the grammar's state after each)."""
    cut = {}
    for request, proposal in proposals.items():
        if request.grammar is not None and proposal.tokens:
            request.grammar.catch_up(request)
            n = request.grammar.valid_prefix(proposal.tokens)
            if n < len(proposal.tokens):
                proposal = replace(proposal, tokens=proposal.tokens[:n],
                                   probs=None if proposal.probs is None else proposal.probs[:n])
        cut[request] = proposal
    return cut


def mask_draft(request, logprobs: mx.array, drafted: list[int]) -> mx.array:
    """A draft model's `logprobs [vocab]` for a constrained row's next proposal, masked as the
    grammar stands after the tokens drafted so far: the matcher consumes them, and rolls them
    back after the mask, so a draft proposes only what the grammar allows (an unmasked draft's
    first token was nearly always refused, and its proposals cut to none)."""
    matcher = request.grammar
    matcher.catch_up(request)
    start = time.perf_counter()
    consumed = 0
    for token in drafted:
        if matcher.stopped or not matcher.ll.consume_token(int(token)):
            break
        consumed += 1
    compiler = matcher.compiler
    bitmask = np.full((1, _words(compiler.vocab_size)), -1, dtype=np.int32)
    if consumed == len(drafted):
        _fill(compiler, [(matcher, 0, None)], bitmask)
    else:
        _eos_only(bitmask, 0, compiler.eos_ids, 1)  # the draft went past the grammar's end: nothing more fits
    if consumed:
        matcher.ll.rollback(consumed)
    masked = apply_bitmask(logprobs.reshape(1, -1), bitmask).reshape(logprobs.shape)
    compiler.stats.mask_s += time.perf_counter() - start
    return masked


def apply_bitmask(logits: mx.array, bitmask: np.ndarray) -> mx.array:
    """`logits [N, vocab]` with the tokens whose bit is 0 in `bitmask [N, words]` at -inf."""
    n, vocab = logits.shape
    words = mx.array(bitmask.view(np.uint32))
    # Made here, not at import: an MLX array belongs to the stream of the thread that made it.
    bits = mx.right_shift(words[:, :, None], mx.arange(32, dtype=mx.uint32)) & 1
    allowed = bits.reshape(n, -1)[:, :vocab].astype(mx.bool_)
    return mx.where(allowed, logits, mx.array(-mx.inf, dtype=logits.dtype))


def _words(vocab: int) -> int:
    return (vocab + 31) // 32


def _fill(compiler, items: list, bitmask: np.ndarray) -> None:
    """Fill the rows' masks: (matcher, first bitmask row, draft tokens or None) each
    (llguidance refuses an empty draft: a row without proposals takes the plain call)."""
    import llguidance.numpy as lln

    live, drafts = [], []
    for matcher, index, draft in items:
        if matcher.stopped:
            _eos_only(bitmask, index, compiler.eos_ids, 1 + len(draft or ()))
        elif draft is None:
            live.append((matcher.ll, index))
        else:
            drafts.append((matcher.ll, index, draft))
    if live:
        lln.fill_next_token_bitmask_par(compiler.executor, live, bitmask)
    if drafts:
        lln.fill_next_token_bitmask_par_with_draft_tokens(compiler.executor, drafts, bitmask)


def _eos_only(bitmask: np.ndarray, index: int, eos_ids: list[int], rows: int) -> None:
    words = bitmask.view(np.uint32)
    for row in range(index, index + rows):
        words[row] = 0
        for token in eos_ids:
            words[row, token // 32] |= np.uint32(1 << (token % 32))


def _record(compiler, rows, bitmask: np.ndarray, start: float, length: int) -> None:
    """The step's mask time, into the compiler's stats and each row's share (its RequestStats, by the request);
    at DEBUG the tokens each row's masks refused (a popcount, skipped otherwise)."""
    elapsed = time.perf_counter() - start
    compiler.stats.mask_s += elapsed
    compiler.stats.mask_steps += 1
    debug = log.isEnabledFor(logging.DEBUG)
    for i, r in rows:
        refused = 0
        if debug:
            allowed = int(np.bitwise_count(bitmask[i * length].view(np.uint32)).sum())
            refused = max(0, compiler.vocab_size - allowed)
        r.record_mask(elapsed / len(rows), refused)  # the request writes its own stats
