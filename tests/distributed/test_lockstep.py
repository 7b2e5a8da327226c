"""One engine split over two real ranks (MLX ring on loopback), against the single-process run.

Each launch costs seconds, so one launched pair serves a whole scenario:
greedy tokens and prefix hits, then a batch of 4 in which one client hangs
up mid-prefill and one closes its stream, with the step-cost guard on and
every step's plan, tables and tokens digested and agreed (a difference
stops both ranks); then a restart of both ranks on the same SSD tier.
"""

from pathlib import Path

import pytest

from lockstep_prompts import FIRST, SECOND, config_fields
from ranks import run_ranks

from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine

HERE = Path(__file__).parent
pytestmark = pytest.mark.slow


def _one_process(model: str) -> dict:
    engine = Engine.load(model, CacheConfig(**config_fields()))
    return {name: engine.generate(prompt, max_tokens=8) for name, prompt in (("first", FIRST), ("second", SECOND))}


def _launch(tmp_path: Path, model: str, kind: str, scenario: str) -> dict:
    run = tmp_path / scenario
    run.mkdir()
    results = run_ranks(HERE / "rank_engine.py", run, timeout=90, args=(model, kind, str(tmp_path / "disk"), scenario))
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    leader, follower = (r.records() for r in results)
    assert leader[-1]["leader_steps"] == follower[-1]["follower_steps"] > 0
    return {rec.get("name", "batch" if "batch" in rec else "end"): rec for rec in leader}


def _same_as_one_process(got: dict, oracle: dict) -> None:
    for name in ("first", "second"):
        assert got[name]["tokens"] == oracle[name].tokens
        assert got[name]["cached"] == sum(oracle[name].stats.cached_tokens.values())
    assert got["second"]["cached"] == 32  # the first prompt's two full blocks


def _batch_ran_in_step(got: dict) -> None:
    batch = got["batch"]
    assert batch["reasons"] == ["length", "cancelled", "length", "length"]
    assert [len(tokens) for tokens in batch["batch"]] == [6, 1, 6, 6]


@pytest.mark.parametrize("family, kind", [("llama", "tensor"), ("qwen3", "tensor"), ("qwen2", "pipeline")])
def test_a_split_model_gives_the_one_process_tokens_and_hits(tmp_path, model_dirs, family, kind):
    model = model_dirs[family]
    got = _launch(tmp_path, model, kind, "first")
    _same_as_one_process(got, _one_process(model))
    _batch_ran_in_step(got)
    if family == "llama":  # a restart of both ranks restores the prefix from their SSD tiers
        again = _launch(tmp_path, model, kind, "restart")
        assert again["first"]["tokens"] == got["first"]["tokens"]
        assert again["first"]["tiers"]["disk"] == 32
        # Each rank wrote its own shard's bytes, under the set's identity and its shard tag.
        assert len([p for p in (tmp_path / "disk").iterdir() if p.is_dir()]) == 2
