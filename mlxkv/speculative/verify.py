"""Which proposed tokens the target model accepts, row by row.

A row's query was its last token and its k proposals; the target's
logprobs at position j are its distribution for the token after j.
- Greedy rows accept the longest run of proposals equal to the target's
  argmax, then take the argmax where they differ (or after the last).
- Sampled rows follow the standard speculative rule, so the tokens are
  distributed as the target's: proposal x at j is accepted with
  probability min(1, p_j(x) / q_j(x)) (q: the proposer's distribution; a
  prompt lookup proposes x for sure, q_j(x) = 1); at the first rejection
  the token is drawn from max(p_j - q_j, 0), normalised; after k
  acceptances a bonus token is drawn from p_k.
p is the request's own sampling distribution (its temperature, top-p,
min-p, top-k), and every draw uses the request's key.
"""

from __future__ import annotations

import mlx.core as mx


def greedy_tokens(best: list[int], proposals: list[int]) -> list[int]:
    """The accepted proposals and the target's next token, from its argmax at each position."""
    out = []
    for j, token in enumerate(proposals):
        if best[j] != token:
            break
        out.append(token)
    out.append(best[len(out)])
    return out


def sampled_tokens(sampler, logprobs: mx.array, proposals: list[int], draft_probs: mx.array | None = None) -> list[int]:
    """`logprobs [k+1, vocab]` of one row; `draft_probs [k, vocab]` the proposer's (None: a sure proposal)."""
    k = len(proposals)
    scores = sampler.scores(logprobs[: k + 1])
    n = k
    if k:
        probs = mx.softmax(scores[:k], axis=-1)
        picked = mx.array(proposals)
        p_x = probs[mx.arange(k), picked]
        q_x = 1.0 if draft_probs is None else draft_probs[mx.arange(k), picked]
        accepted = (sampler.uniform(k) < mx.minimum(p_x / q_x, 1.0)).tolist()
        n = accepted.index(False) if False in accepted else k
    if n == k:
        return proposals + [int(sampler.categorical(scores[k]).item())]
    p = mx.softmax(scores[n], axis=-1)
    q = mx.zeros_like(p).at[proposals[n]].add(1.0) if draft_probs is None else draft_probs[n]
    residual = mx.maximum(p - q, 0.0)
    return proposals[:n] + [int(sampler.categorical(mx.log(residual)).item())]
