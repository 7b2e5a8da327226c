"""A checkpoint with a vision tower: a vision model with mlx-vlm, its text half without."""

import logging

import pytest

from mlxkv.cli import main
from mlxkv.errors import MlxkvError
from mlxkv.models.loader import load_model
from mlxkv.vision import compat
from mlxkv.vision.model import VisionModel
from mlxkv.vision.prompt import vision_prompt

pytestmark = pytest.mark.slow  # loads models


def test_the_cli_writes_the_same_tiny_vision_model(qwen2_vl_dir, tmp_path, capsys):
    assert main(["tiny-model", str(tmp_path / "m"), "--family", "qwen2_vl"]) == 0
    for name in ("model.safetensors", "config.json", "tokenizer.json", "preprocessor_config.json"):
        assert (tmp_path / "m" / name).read_bytes() == (qwen2_vl_dir / name).read_bytes()


def test_it_loads_as_a_vision_model_with_mlx_vlm_and_as_text_without(qwen2_vl_dir, monkeypatch, caplog):
    assert isinstance(load_model(str(qwen2_vl_dir)).model, VisionModel)
    monkeypatch.setattr(compat, "available", lambda: False)
    with caplog.at_level(logging.INFO, logger="mlxkv.vision.loading"):
        text = load_model(str(qwen2_vl_dir))
    assert not isinstance(text.model, VisionModel)
    assert [r.message for r in caplog.records if "vision tower" in r.message] == [
        f"{qwen2_vl_dir} has a vision tower; loading its text half only (pip install 'mlxkv[vision]' for images)"]
    with pytest.raises(MlxkvError, match="this model takes text only"):
        vision_prompt(text.model, [{"role": "user", "content": [{"type": "image", "image": b""}]}])
