"""Which splits each family allows, refused in one line before any weight loads."""

import pytest

from mlxkv.distributed.sharding import ShardSpec, check_checkpoint
from mlxkv.errors import MlxkvError
from mlxkv.models.tiny import TinyModelSpec, write_tiny_model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("shard-models")
    specs = {
        "llama": TinyModelSpec(family="llama", num_heads=4, num_kv_heads=2, num_layers=2),
        "qwen3_next": TinyModelSpec(family="qwen3_next", num_layers=4),
        "gemma3_text": TinyModelSpec(family="gemma3_text", num_layers=2),
    }
    return {name: write_tiny_model(root / name, spec) for name, spec in specs.items()}


def test_a_family_splits_the_ways_mlx_lm_can_split_it(checkpoints):
    check_checkpoint(checkpoints["llama"], "tensor", 2)
    check_checkpoint(checkpoints["qwen3_next"], "pipeline", 2)
    with pytest.raises(MlxkvError, match="llama has no pipeline split"):
        check_checkpoint(checkpoints["llama"], "pipeline", 2)
    with pytest.raises(MlxkvError, match="gemma3_text has no tensor-parallel split"):
        check_checkpoint(checkpoints["gemma3_text"], "tensor", 2)


def test_a_head_count_the_ranks_cannot_divide_is_one_line(checkpoints):
    # 2 KV heads over 4 ranks: mlx-lm would fail reshaping to an empty array mid-load.
    with pytest.raises(MlxkvError, match="2 KV heads, which 4 ranks cannot split") as error:
        check_checkpoint(checkpoints["llama"], "tensor", 4)
    assert "\n" not in str(error.value)
    with pytest.raises(MlxkvError, match="fewer than the 8 pipeline stages"):
        check_checkpoint(checkpoints["qwen3_next"], "pipeline", 8)


def test_a_missing_checkpoint_and_a_bad_mode_are_one_line(tmp_path):
    with pytest.raises(MlxkvError, match="could not read the model"):
        check_checkpoint(tmp_path / "nothing", "tensor", 2)
    with pytest.raises(MlxkvError, match="unknown --distributed mode 'data'"):
        ShardSpec("data", 2, 0)
    assert ShardSpec("pipeline", 4, 3).tag == "pp4r3"
