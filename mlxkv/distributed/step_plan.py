"""Rank 0's step plan: every input of a step that only rank 0 can know, as bytes.

Every rank runs the same deterministic scheduler on the same pool
(distributed/lockstep.py), so the plan carries no block table: only what
would otherwise differ per rank. New requests (prompt, sampling and seed),
cancels and aborts (rank 0's clients), the pause rank 0 measured (idle
shrink, idle checkpoint writes) and the choices rank 0's clock makes for the
step (the step-cost guard's), all in the order rank 0 applied them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

STEP, IDLE, CLOSE = "step", "idle", "close"


@dataclass
class NewRequest:
    """What a rank needs to build rank 0's request: the same id, tokens, sampler and root."""

    request_id: int
    prompt: list[int]
    max_tokens: int
    sampling: tuple  # temperature, top_p, min_p, top_k, seed
    root: str | None  # the hash root, hex
    speculative: bool = False


@dataclass
class StepPlan:
    op: str = STEP  # step, idle (a pause of idle_s seconds) or close
    idle_s: float = 0.0
    new: list[NewRequest] = field(default_factory=list)
    cancel: list[int] = field(default_factory=list)  # request ids whose client asked to stop
    abort: list[int] = field(default_factory=list)  # request ids whose client went away
    decisions: dict = field(default_factory=dict)  # EngineCore.decisions() on rank 0

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> StepPlan:
        fields = json.loads(data)
        fields["new"] = [NewRequest(**{**r, "sampling": tuple(r["sampling"])}) for r in fields["new"]]
        return cls(**fields)
