"""The prompts and engine options the lockstep ranks and their single-process oracle share."""

FIRST = list(range(1, 40))  # 2 full blocks of 16 and a tail
SECOND = FIRST + [7, 8, 9, 10, 11]  # the first's blocks are a prefix hit
# Long enough that 4 of them take several 2048-token prefill steps.
BATCH = [[(i * 31 + j * 7) % 500 + 1 for j in range(1200)] for i in range(4)]
CANCELLED = 1  # its client hangs up after the first step, while it prefills


def config_fields() -> dict:
    """The step-cost guard is on: lookup speculation, whose per-rank clock rank 0 decides for all."""
    return {"block_size": 16, "speculative": "lookup", "memory_tier_bytes": 0}
