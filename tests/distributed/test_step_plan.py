"""A step plan reaches every rank as rank 0 wrote it."""

from mlxkv.distributed.step_plan import IDLE, STEP, NewRequest, StepPlan


def test_a_plan_decodes_to_what_was_encoded():
    plan = StepPlan(new=[NewRequest(3, [1, 2, 3], 8, (0.7, 0.9, 0.0, 0, 12345), "ab" * 32, True)],
                    cancel=[1], abort=[2], decisions={"speculate": {"1": False}})
    assert StepPlan.decode(plan.encode()) == plan
    assert StepPlan.decode(StepPlan(IDLE, idle_s=2.5).encode()) == StepPlan(IDLE, idle_s=2.5)


def test_a_step_with_nothing_new_is_zero_bytes():
    assert StepPlan(STEP).encode() == b"" and StepPlan.decode(b"") == StepPlan()
    assert StepPlan.decode(StepPlan(report=True).encode()).report
