"""Run a step plan on the model: prefill chunks one by one, then one batched decode.

Each prefill chunk is its own forward of one sequence, the same shapes a
solo run computes, so a batched request's KV equals its solo run's. All
requests ready to decode then go through one forward of B rows, one new
token each (or, in a speculative step, each row's last token and its
proposals, padded to one length L), with per-row RoPE offsets, block
tables and context lengths (paged_cache.PagedBatch); the kernel path
serves batch x heads. The runner returns what each forward computed; the
cache coordinator records it. A draft model's sequences (engine/sequences.py)
run through the same two functions, `prefill_chunk` and `forward_rows`.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from mlxkv.cache.coordinator import KVCacheCoordinator
from mlxkv.cache.sequence import Sequence
from mlxkv.engine.model_runner import ModelRunner
from mlxkv.engine.scheduler import StepPlan
from mlxkv.structured import masks


def run_prefill(plan: StepPlan, runner: ModelRunner, cache: KVCacheCoordinator) -> None:
    for request, n in plan.prefill:
        seq = request.seq
        prefill_chunk(runner, cache, seq, seq.prompt[seq.num_computed : seq.num_computed + n])


def prefill_chunk(runner: ModelRunner, cache: KVCacheCoordinator, seq: Sequence, tokens: list[int]) -> None:
    """One forward of `tokens`, the next of `seq`'s known tokens, into its allocated slots; evaluated."""
    out = runner.forward([seq], mx.array([tokens]), mirror=False)
    cache.computed([seq], len(tokens), out.states)
    # A pipeline stage's logits too: only they depend on what this rank sends the next
    # stage, so without them the next stage waits forever. Elsewhere they are left unevaluated:
    # the output layer over a whole chunk is a quarter of a small model's prefill.
    pipelined = (out.logits,) if runner.pipelined else ()
    mx.eval(runner.kv_pool.arrays, out.state_arrays, *pipelined)


def forward_rows(runner: ModelRunner, cache: KVCacheCoordinator, seqs: list[Sequence], inputs: mx.array,
                 every_position: bool = False, mask: Callable[[mx.array], mx.array] | None = None) -> mx.array:
    """One batched forward of `inputs [B, L]`, row i continuing `seqs[i]` (slots allocated);
    lazy logprobs at each row's last position (`every_position`: `[B, L, vocab]`). `mask`: the
    constrained rows' grammar masks on the logits (structured/masks.py), before normalizing."""
    # A lone sequence keeps its contiguous mirror: solo decode speed.
    out = runner.forward(seqs, inputs, mirror=len(seqs) == 1, every_position=every_position)
    cache.computed(seqs, inputs.shape[1], out.states)
    logits = out.logits if mask is None else mask(out.logits)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def run_step(plan: StepPlan, runner: ModelRunner, cache: KVCacheCoordinator,
             decode_inputs: mx.array | None) -> mx.array | None:
    """Queue the plan's work; returns the lazy token sampled for each decode request, in order.

    `decode_inputs [B, 1]` are the decode requests' last tokens, which may
    themselves be lazy (sampled by a step still in flight).
    """
    run_prefill(plan, runner, cache)
    if not plan.decode:
        return None
    mask = (lambda logits: masks.mask_decode(plan.decode, decode_inputs, logits)) \
        if masks.constrained(plan.decode) else None
    logprobs = forward_rows(runner, cache, [r.seq for r in plan.decode], decode_inputs, mask=mask)
    sampled = [r.sampler(logprobs[i : i + 1]).reshape(-1) for i, r in enumerate(plan.decode)]
    return mx.concatenate(sampled) if len(sampled) > 1 else sampled[0]


def run_verify(plan: StepPlan, runner: ModelRunner, cache: KVCacheCoordinator,
               proposals: dict) -> mx.array | None:
    """A speculative step: the prefill chunks, then one forward of every decode row's last
    token and proposals (padded to the plan's decode_len); returns logprobs `[B, L, vocab]`."""
    run_prefill(plan, runner, cache)
    if not plan.decode:
        return None
    rows = []
    for request in plan.decode:
        proposal = proposals.get(request)
        row = [request.seq.last_token, *(proposal.tokens if proposal else [])]
        rows.append(row + [row[-1]] * (plan.decode_len - len(row)))  # padding: computed, never kept
    mask = (lambda logits: masks.mask_verify(plan.decode, proposals, logits)) \
        if masks.constrained(plan.decode) else None
    return forward_rows(runner, cache, [r.seq for r in plan.decode], mx.array(rows), every_position=True,
                        mask=mask)
