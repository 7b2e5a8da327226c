"""What proposes tokens: one interface for prompt lookup, a draft model, or a test's script.

A proposer answers for a batch of rows at once (a draft model runs them as
one batch): for each request, up to k tokens it expects next, and, when it
has one, the distribution it drew each from (a sampled row's acceptance
needs it; a proposal without one was certain, q(x) = 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

from mlxkv.speculative.prompt_lookup import PromptLookup


@dataclass
class Proposal:
    tokens: list[int]
    probs: mx.array | None = None  # [len(tokens), vocab]: the proposer's distribution at each


class Proposer(Protocol):
    def propose(self, requests: list, lengths: list[int]) -> list[Proposal]:
        """Up to lengths[i] tokens for requests[i] (0: none asked)."""

    def forget(self, request) -> None:
        """The request ended."""


class LookupProposer:
    """Prompt lookup (prompt_lookup.py): an index per request, kept up to date as its tokens come."""

    def __init__(self):
        self._indexes: dict[object, PromptLookup] = {}

    def _index(self, request) -> PromptLookup:
        index = self._indexes.get(request)
        if index is None:
            index = self._indexes[request] = PromptLookup(request.prompt)
        known = len(request.prompt) + request.num_output
        if len(index) < known:
            index.extend(request.tokens_since(len(index)))
        return index

    def propose(self, requests: list, lengths: list[int]) -> list[Proposal]:
        return [Proposal(self._index(r).propose(k) if k > 0 else []) for r, k in zip(requests, lengths)]

    def forget(self, request) -> None:
        self._indexes.pop(request, None)
