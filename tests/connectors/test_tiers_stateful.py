"""Random programs over the pool and both tiers never serve KV that differs from a recompute.

Greedy tokens are the observable: with fp32 tiny models, any wrong K/V
(a wrong block, a stale file, a bad hydrate) changes them.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.models.tiny import TinyModelSpec, write_tiny_model

BLOCK = 4
MAX_TOKENS = 3
_MODEL = {}


@pytest.fixture(scope="module", autouse=True)
def _model(tmp_path_factory):
    """The machines' model, under pytest's temp dir (one of its own in /tmp was left behind by every run)."""
    path = str(write_tiny_model(tmp_path_factory.mktemp("stateful") / "m", TinyModelSpec(seed=21)))
    cold = Engine.load(path, CacheConfig(block_size=BLOCK, num_blocks=64, memory_tier_bytes=0))
    _MODEL.update(path=path, cold=cold, answers={})
    yield
    _MODEL.clear()


def model_path() -> str:
    return _MODEL["path"]


def cold_tokens(prompt: tuple[int, ...]) -> list[int]:
    answers = _MODEL["answers"]
    if prompt not in answers:
        answers[prompt] = _MODEL["cold"].generate(list(prompt), max_tokens=MAX_TOKENS).tokens
    return answers[prompt]


# A few stems and tails: prompts share prefixes of different lengths.
STEMS = [tuple((s * 37 + 11 * i) % 300 + 3 for i in range(n)) for s, n in ((1, 12), (2, 9), (3, 16))]
TAILS = [(), (5, 6, 7), (9,) * 6, tuple(range(40, 52))]


class TierMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.disk_dir = tempfile.mkdtemp(prefix="mlxkv-tiers-")
        self.engine = None
        self.restart()
        self.generated = 0

    def _new_engine(self) -> Engine:
        block_bytes = 2 * 2 * BLOCK * 16 * 4 * 2  # layers * kv_heads * block * head_dim * fp32 * (K, V)
        return Engine.load(model_path(), CacheConfig(
            block_size=BLOCK,
            num_blocks=12,  # one prompt fits, two do not
            memory_tier_bytes=3 * block_bytes,  # a tiny memory tier spills to disk
            disk_tier=self.disk_dir,
        ))

    @rule()
    def restart(self):
        if self.engine is not None:
            self.engine.close()
        self.engine = self._new_engine()

    @rule(stem=st.sampled_from(STEMS), tail=st.sampled_from(TAILS))
    def generate(self, stem, tail):
        prompt = stem + tail
        result = self.engine.generate(list(prompt), max_tokens=MAX_TOKENS)
        assert result.tokens == cold_tokens(prompt)
        s = result.stats
        assert s.computed_tokens + sum(s.cached_tokens.values()) == len(prompt)
        assert sum(s.cached_tokens.values()) <= (len(prompt) - 1) // BLOCK * BLOCK
        self.generated += 1

    @precondition(lambda self: self.generated > 0)
    @rule(index=st.integers(0, 1000))
    def flip_a_bit_on_disk(self, index):
        self.engine.connector.disk.flush()
        files = sorted(Path(self.disk_dir).rglob("*.safetensors"))
        if files:
            path = files[index % len(files)]
            data = bytearray(path.read_bytes())
            data[-1 - index % 64] ^= 0x01
            path.write_bytes(bytes(data))

    @invariant()
    def pool_is_whole_between_requests(self):
        usage = self.engine.stats()["pool"]
        assert usage["in_use"] == 0
        assert usage["free"] + usage["cached_free"] == usage["size_blocks"]
        for block_hash, block in self.engine.block_pool.cached.items():
            assert block.block_hash == block_hash

    def teardown(self):
        self.engine.close()
        shutil.rmtree(self.disk_dir, ignore_errors=True)


TierMachine.TestCase.settings = settings(
    max_examples=12, stateful_step_count=14, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_tiers = pytest.mark.slow(TierMachine.TestCase)
