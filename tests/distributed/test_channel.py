"""The step-plan channel and the set-wide fingerprint on two real ranks (MLX ring on loopback)."""

import hashlib
from pathlib import Path

import pytest

from ranks import run_ranks

HERE = Path(__file__).parent
pytestmark = pytest.mark.slow


def _expected(size: int) -> str:
    return hashlib.sha256(bytes((i * 7 + size) % 256 for i in range(size))).hexdigest()


def test_every_rank_receives_rank_zeros_plans_and_stops_on_disagreement(tmp_path):
    results = run_ranks(HERE / "rank_channel.py", tmp_path)
    for r in results:
        assert r.returncode == 0, r.stderr
    records = [r.records() for r in results]
    plans = [[rec for rec in recs if "size" in rec] for recs in records]
    for rank_plans in plans:
        assert [p["length"] for p in rank_plans] == [p["size"] for p in rank_plans]
        assert [p["digest"] for p in rank_plans] == [_expected(p["size"]) for p in rank_plans]
    # Both ranks grew the buffer alike (or the next collective's shapes would differ).
    assert [p["capacity"] for p in plans[0]] == [p["capacity"] for p in plans[1]]
    assert plans[0][-1]["capacity"] >= 5008
    # One collective per plan that fits, two for each that does not (57, 300 and 5000 bytes).
    assert records[0][len(plans[0])]["collectives"] == len(plans[0]) + 3
    mismatch = [rec["mismatch"] for recs in records for rec in recs if "mismatch" in rec]
    assert all(m and "rank 1 differs from rank 0" in m for m in mismatch) and len(mismatch) == 2
    prints = [rec for recs in records for rec in recs if "fingerprint" in rec]
    assert prints[0]["fingerprint"] == prints[1]["fingerprint"]
    assert [p["tag"] for p in prints] == ["tp2r0", "tp2r1"]


def test_a_lost_rank_is_an_error_on_rank_zero_not_a_hang(tmp_path):
    results = run_ranks(HERE / "rank_lost.py", tmp_path, timeout=60)
    assert results[1].returncode == 3
    assert results[0].returncode == 0, results[0].stderr
    (record,) = results[0].records()
    assert record["lost"] and "a peer was lost" in record["lost"]
    assert record["seconds"] < 30
