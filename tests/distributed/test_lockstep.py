"""Engines split over two real ranks (MLX ring on loopback), against the single-process run.

A launch costs seconds, so one launched pair runs every split in turn: greedy
tokens and prefix hits (a hybrid too: qwen3_next's recurrent state crosses
the pipeline stages), then (once per split: tensor, pipeline) a batch of 4
in which one client hangs up mid-prefill and one closes its stream, with the
step-cost guard on and every step's plan, tables and tokens digested and
agreed (a difference stops both ranks). A second launch restarts both ranks
on the SSD tiers the first left, with no Redis: each rank reads its own shard
back. test_serve.py starts a second set of the same shape on the same Redis tier.
"""

from pathlib import Path

import pytest

from lockstep_prompts import FIRST, SECOND, config_fields
from ranks import run_ranks

from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.models.tiny import TinyModelSpec, write_tiny_model

HERE = Path(__file__).parent
pytestmark = pytest.mark.slow
SPLITS = [("llama", "tensor"), ("qwen3", "tensor"), ("qwen2", "pipeline"), ("qwen3_next", "pipeline")]
# 4 layers: each stage holds recurrent layers, and one of them the attention layer.
HYBRID = TinyModelSpec(family="qwen3_next", num_layers=4)
BATCHED = [0, 2]  # each split's first job: rank_engine.py runs the batch once per split


def _launch(run: Path, disk: Path, scenario: str, jobs: list[str]) -> list[dict]:
    """Each rank's records by (job, name); both ranks must exit cleanly after equal step counts."""
    results = run_ranks(HERE / "rank_engine.py", run, timeout=150, args=(str(disk), scenario, *jobs))
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    leader, follower = ({(rec["job"], rec["name"]): rec for rec in r.records()} for r in results)
    for job in range(len(jobs)):
        assert leader[job, "end"]["steps"] == follower[job, "end"]["steps"] > 0
    return [leader, follower]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, model_dirs):
    """The shared tiny models and this module's hybrid."""
    hybrid = write_tiny_model(tmp_path_factory.mktemp("lockstep-models") / "qwen3_next", HYBRID)
    return {**model_dirs, "qwen3_next": str(hybrid)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, dirs):
    root = tmp_path_factory.mktemp("lockstep")
    jobs = [f"{dirs[family]}={kind}" for family, kind in SPLITS]
    return _launch(root, root / "disk", "first", jobs)[0], root


@pytest.mark.parametrize("job, family", [(i, family) for i, (family, _) in enumerate(SPLITS)])
def test_a_split_model_gives_the_one_process_tokens_and_hits(ranks, dirs, job, family):
    got, _ = ranks
    engine = Engine.load(dirs[family], CacheConfig(**config_fields()))
    for name, prompt in (("first", FIRST), ("second", SECOND)):
        oracle = engine.generate(prompt, max_tokens=8)
        assert got[job, name]["tokens"] == oracle.tokens
        assert got[job, name]["cached"] == sum(oracle.stats.cached_tokens.values())
    assert got[job, "second"]["cached"] == 32  # the first prompt's two full blocks


@pytest.mark.parametrize("job", BATCHED)
def test_a_client_hanging_up_mid_prefill_keeps_the_ranks_in_step(ranks, job):
    batch = ranks[0][job, "batch"]  # every step's digests agreed, or the ranks had stopped
    assert batch["reasons"] == ["length", "cancelled", "length", "length"]
    assert [len(tokens) for tokens in batch["tokens"]] == [6, 1, 6, 6]


def test_each_rank_writes_its_own_shard_to_the_ssd_tier(ranks):
    _, root = ranks
    # Each rank wrote its own shard's bytes, under the set's identity and its shard tag.
    fingerprints = [p for p in (root / "disk").iterdir() if p.is_dir()]
    assert len(fingerprints) == 2 * len(SPLITS)


def test_a_restart_of_both_ranks_restores_the_prefix_from_their_ssd_tiers(ranks, dirs):
    first, root = ranks
    run = root / "restart"
    run.mkdir()
    leader, follower = _launch(run, root / "disk", "restart", [f"{dirs['llama']}=tensor"])
    assert leader[0, "first"]["tokens"] == first[0, "first"]["tokens"]
    assert leader[0, "first"]["tiers"]["disk"] == 32  # the first prompt's two full blocks
    # Each rank read its own shard back from its own SSD tier (there is no other tier to read).
    assert leader[0, "end"]["disk_hydrations"] > 0 and follower[0, "end"]["disk_hydrations"] > 0
