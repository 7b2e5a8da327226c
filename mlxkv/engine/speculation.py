"""Speculative decoding in the batch: which rows propose this step, and what the target accepts.

A step that speculates gives each decoding row a query of its last token
and the tokens its proposer expects next (none for a row that is paused
or finds none), padded to one length L, so a single forward of the target
checks every row (run.py). The target's logprobs at each position decide
what each row keeps (speculative/verify.py); the coordinator then rolls
each sequence back to the tokens kept (its rejected tokens' KV is never
registered nor written to a tier), and postprocess hands the tokens out.

The loop owns one of these; it keeps each request's proposal length (and
its proposer, its own state) across steps and preemptions.
"""

from __future__ import annotations

import mlx.core as mx

from mlxkv.engine.request import Request
from mlxkv.speculative.proposal_length import ProposalLength
from mlxkv.speculative.proposer import Proposal, Proposer
from mlxkv.speculative.stats import SpeculationStats
from mlxkv.speculative.step_cost import StepCost
from mlxkv.speculative.verify import greedy_tokens, sampled_tokens
from mlxkv.structured.masks import cut_proposals


class Speculation:
    def __init__(self, proposer: Proposer, max_tokens: int, cost: StepCost | None = None):
        self.proposer = proposer
        self.max_tokens = max_tokens  # the most a row proposes in one step
        self.stats = SpeculationStats()
        self.cost = cost or StepCost()  # the loop times each step into it
        self._lengths: dict[Request, ProposalLength] = {}

    def _length(self, request: Request) -> ProposalLength:
        length = self._lengths.get(request)
        if length is None:
            length = self._lengths[request] = ProposalLength(self.max_tokens)
        return length

    @staticmethod
    def _room(request: Request) -> int:
        """Proposals a request may still take: its reply ends at max_tokens, one token more than accepted."""
        return request.max_tokens - request.num_output - 1

    def wants_step(self, requests: list[Request]) -> bool:
        """Whether some decoding row would propose now and verify steps pay at this batch size
        (else the step decodes plain, pipelined); a paused row's pause runs down a step."""
        wants = False
        for request in requests:
            if not request.speculative:
                continue
            length = self._length(request)
            if length.active and self._room(request) > 0:
                wants = True
            else:
                length.tick()
        return wants and self.cost.speculate(len(requests))

    def propose(self, requests: list[Request]) -> dict[Request, Proposal]:
        """Each decoding row's proposal (maybe empty)."""
        ks = [min(self._length(r).next(), self._room(r)) if r.speculative else 0 for r in requests]
        proposals = cut_proposals(dict(zip(requests, self.proposer.propose(requests, ks))))
        for request, k in zip(requests, ks):
            if k > 0 and not proposals[request].tokens:
                self._length(request).observe(0, 0)  # none found: a row that keeps finding none pauses
        return proposals

    def accept(self, requests: list[Request], logprobs: mx.array, proposals: dict[Request, Proposal]) -> list[list[int]]:
        """The tokens each row keeps from a verify step's `logprobs [B, L, vocab]`."""
        best = mx.argmax(logprobs, axis=-1).tolist()  # one read for every greedy row
        kept = []
        for i, request in enumerate(requests):
            proposal = proposals.get(request) or Proposal([])
            if request.sampler.greedy:
                tokens = greedy_tokens(best[i], proposal.tokens)
            else:
                tokens = sampled_tokens(request.sampler, logprobs[i], proposal.tokens, proposal.probs)
            if proposal.tokens:
                self._observe(request, len(proposal.tokens), len(tokens) - 1)
            kept.append(tokens)
        self.stats.steps += 1
        return kept

    def _observe(self, request: Request, proposed: int, accepted: int) -> None:
        self._length(request).observe(proposed, accepted)
        self.stats.observe(proposed, accepted)
        request.record_proposal(proposed, accepted)  # the reply's own share, for its last record

    def forget(self, request: Request) -> None:
        self._lengths.pop(request, None)
        self.proposer.forget(request)
