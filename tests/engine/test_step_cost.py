"""Speculation stops where verify steps cost more than they give: the clock decides, per batch size."""

from __future__ import annotations

import pytest

from family_support import model_with_oracle, prompt_of
from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.models.tiny import TinyModelSpec
from mlxkv.speculative.step_cost import PROBE_COST, PROBE_EVERY, PROBE_EVERY_MAX, PROBE_STEPS, StepCost


class Timed(StepCost):
    """A clock on which a verify step takes `verify_s` and a plain step `plain_s`, per batch size."""

    def __init__(self, verify_s, plain_s):
        super().__init__(clock=lambda: self.now)
        self.now, self.verify_s, self.plain_s = 0.0, verify_s, plain_s

    def start(self, rows, speculated):
        super().start(rows, speculated)
        cost = self.verify_s if speculated else self.plain_s
        self.now += cost(rows) if callable(cost) else cost


def run(cost: StepCost, steps: int, rows: int = 1, tokens=None) -> list[bool]:
    """`steps` steps as the loop takes them; which of them speculated."""
    kinds = []
    for _ in range(steps):
        speculated = cost.speculate(rows)
        cost.start(rows, speculated)
        cost.finish(tokens(speculated) if tokens else (3 * rows if speculated else rows), prefilled=False)
        kinds.append(speculated)
    return kinds


def test_slow_verify_steps_give_way_to_plain_decode_and_are_probed_again():
    kinds = run(Timed(verify_s=0.32, plain_s=0.1), 2 * PROBE_EVERY)  # 3 / 0.32 = 9.4 tokens a second against 10
    assert kinds[:PROBE_STEPS] == [True] * PROBE_STEPS  # learns speculation first, then plain
    plain = kinds[PROBE_STEPS:]  # its learning steps start the run of plain steps
    assert plain[:PROBE_EVERY] == [False] * PROBE_EVERY
    assert plain[PROBE_EVERY : PROBE_EVERY + PROBE_STEPS] == [True] * PROBE_STEPS  # a probe, then back
    assert plain[PROBE_EVERY + PROBE_STEPS] is False


@pytest.mark.parametrize("verify_s", [0.35, 1.0])  # 8.6 and 3 tokens a second against 10
def test_probes_of_a_far_slower_kind_are_rare_enough_to_cost_little(verify_s):
    cost = Timed(verify_s=verify_s, plain_s=0.1)
    run(cost, 2 * PROBE_STEPS)  # learned
    began = cost.now
    kinds = run(cost, 3 * PROBE_EVERY_MAX)
    tokens = sum(3 if k else 1 for k in kinds)
    loss = 1 - tokens / (cost.now - began) / 10  # against plain decode alone, 10 tokens a second
    assert any(kinds) and loss <= PROBE_COST * 1.1 + 0.002, (loss, kinds.count(True))


def test_verify_steps_that_pay_keep_running_with_a_short_probe_of_plain_decode():
    kinds = run(Timed(verify_s=0.15, plain_s=0.1), 4 * PROBE_EVERY)  # 20 tokens a second against 10
    learned = kinds[2 * PROBE_STEPS :]
    assert sum(not k for k in learned) <= 3 * PROBE_STEPS and learned[:PROBE_EVERY] == [True] * PROBE_EVERY


@pytest.mark.parametrize("verify_s, speculates", [(0.31, False), (0.29, True)])  # 9.7 or 10.3 tokens/s against 10
def test_the_faster_kind_runs_however_close_the_call(verify_s, speculates):
    kinds = run(Timed(verify_s=verify_s, plain_s=0.1), PROBE_EVERY)
    assert all(k == speculates for k in kinds[2 * PROBE_STEPS :])


def test_each_batch_size_learns_its_own_answer():
    cost = Timed(verify_s=lambda rows: 0.15 if rows == 1 else 2.0 * rows, plain_s=0.1)
    run(cost, 3 * PROBE_STEPS, rows=1)
    run(cost, 3 * PROBE_STEPS, rows=8)
    assert cost.speculate(1) and not cost.speculate(8) and not cost.speculate(5)  # 5 rows: the bucket of 8
    assert cost.describe()["8"]["plain_tok_s"] > cost.describe()["8"]["speculated_tok_s"]


def test_steps_that_prefill_or_hand_out_nothing_are_not_counted():
    cost = Timed(verify_s=0.15, plain_s=0.1)
    for speculated in (True, False):
        for prefilled, tokens in ((True, 3), (False, 0)):
            cost.start(1, speculated)
            cost.finish(tokens, prefilled=prefilled)
    assert cost.describe()["1"] == {"speculated_tok_s": 0.0, "plain_tok_s": 0.0}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return model_with_oracle(tmp_path_factory.mktemp("llama"), TinyModelSpec(family="llama", seed=5))


@pytest.mark.parametrize("verify_s, speculates", [(10.0, False), (0.001, True)])
def test_the_engine_decodes_plain_where_verify_steps_do_not_pay(llama, verify_s, speculates):
    _, loaded, reference = llama
    prompt = prompt_of(30, salt=21)
    engine = Engine(loaded, CacheConfig(block_size=16, memory_tier_bytes=0, speculative="lookup"))
    engine.loop.speculation.cost = cost = Timed(verify_s=verify_s, plain_s=0.01)
    answer = reference(prompt, 100)
    assert engine.generate(prompt, max_tokens=100).tokens == answer
    assert engine.generate(prompt + answer[:50], max_tokens=60).tokens == reference(prompt + answer[:50], 60)
    steps = engine.stats()["speculative"]["steps"]
    assert (steps > 3 * PROBE_STEPS) == speculates, (steps, cost.describe())


def test_a_rank_follows_rank_zeros_choices_not_its_own_clock():
    # Rank 0 learned that verify steps are slow at one row; a rank whose clock says the
    # opposite must still decide as rank 0 does (distributed/lockstep.py sends the choices).
    leader = Timed(verify_s=0.32, plain_s=0.1)
    run(leader, 3 * PROBE_STEPS)
    choices = leader.choices()
    assert choices == {1: False}
    follower = Timed(verify_s=0.01, plain_s=0.1)
    run(follower, 3 * PROBE_STEPS)
    follower.follow(choices)
    assert [follower.speculate(1), follower.speculate(2)] == [False, True]  # 2 rows: not measured, learn first
    follower.follow(None)
    assert follower.speculate(1) is True  # its own clock again
