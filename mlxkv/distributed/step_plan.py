"""Rank 0's step plan: every input of a step that only rank 0 can know, as bytes.

Every rank runs the same deterministic scheduler on the same pool
(distributed/lockstep.py), so the plan carries no block table: only what
would otherwise differ per rank. New requests (prompt, sampling and seed),
cancels and aborts (rank 0's clients), the pause rank 0 measured (idle
shrink, idle checkpoint writes), the choices rank 0's clock makes for the
step (the step-cost guard's), and whether every rank sends its report with
the next plan (rank_report.py), all in the order rank 0 applied them.

Only the fields that differ from a plain step are written, so the plan of a
step with nothing new (most decode steps) is zero bytes, or a few bytes of
speculation choices when a draft or lookup speculates: the channel's
fixed-size buffer then carries just its header and them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

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
    report: bool = False  # every rank attaches its report to the next exchange

    def encode(self) -> bytes:
        plain = asdict(StepPlan())
        written = {k: v for k, v in asdict(self).items() if v != plain[k]}
        return json.dumps(written, separators=(",", ":")).encode() if written else b""

    @classmethod
    def decode(cls, data: bytes) -> StepPlan:
        if not data:
            return cls()
        written = json.loads(data)
        if unknown := set(written) - {f.name for f in fields(cls)}:
            raise ValueError(f"a step plan with unknown fields {sorted(unknown)}")
        written["new"] = [NewRequest(**{**r, "sampling": tuple(r["sampling"])}) for r in written.get("new", [])]
        return cls(**written)
