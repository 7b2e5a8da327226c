"""The step-plan channel and the set-wide fingerprint on two real ranks (MLX ring on loopback);
one launched pair for the module, whose rank 1 dies at the end."""

import hashlib
from pathlib import Path

import pytest

from ranks import run_ranks

HERE = Path(__file__).parent
pytestmark = pytest.mark.slow


def _expected(size: int) -> str:
    return hashlib.sha256(bytes((i * 7 + size) % 256 for i in range(size))).hexdigest()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    results = run_ranks(HERE / "rank_channel.py", tmp_path_factory.mktemp("channel"), timeout=60)
    assert results[1].returncode == 3, results[1].stderr
    assert results[0].returncode == 0, results[0].stderr
    return [r.records() for r in results]


def test_every_rank_receives_rank_zeros_plans_and_stops_on_disagreement(ranks):
    plans = [[rec for rec in recs if "size" in rec] for recs in ranks]
    for rank_plans in plans:
        assert [p["length"] for p in rank_plans] == [p["size"] for p in rank_plans]
        assert [p["digest"] for p in rank_plans] == [_expected(p["size"]) for p in rank_plans]
    # The buffer never grows: a long plan costs a second collective on its own step only.
    assert {p["capacity"] for recs in plans for p in recs} == {64}
    # One collective per plan that fits, two for each that does not (65, 300 and 5000 bytes).
    assert ranks[0][len(plans[0])]["collectives"] == len(plans[0]) + 3
    mismatch = [rec["mismatch"] for recs in ranks for rec in recs if "mismatch" in rec]
    assert all(m and "rank 1 differs from rank 0" in m for m in mismatch) and len(mismatch) == 2
    prints = [rec for recs in ranks for rec in recs if "fingerprint" in rec]
    assert prints[0]["fingerprint"] == prints[1]["fingerprint"]
    assert [p["tag"] for p in prints] == ["tp2r0", "tp2r1"]


def test_reports_and_timings_ride_on_the_plan_and_waiting_is_told_apart(ranks):
    timed = [next(rec for rec in recs if "reports" in rec) for recs in ranks]
    for t in timed:
        assert t["reports"] == ["report of rank 0", "report of rank 1"]
    # Rank 1 came 0.5 s late: rank 0 waited for it, rank 1 waited for nobody.
    assert timed[0]["waited"] > 0.4 and timed[0]["seconds"] > 0.4
    assert timed[1]["waited"] < 0.1


def test_a_lost_rank_is_an_error_on_rank_zero_not_a_hang(ranks):
    (record,) = [rec for rec in ranks[0] if "lost" in rec]
    assert record["lost"] and "a peer was lost" in record["lost"]
    assert record["lost_after"] < 30
