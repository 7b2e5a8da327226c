"""Tiny vision models for the vision tests; mlx-vlm is the `vision` extra.

Without mlx-vlm these tests skip, except under CI (CI=true), where the
extra must be installed and a missing one is a failure, not a skip.
"""

import os
from pathlib import Path

import pytest

from mlxkv.vision import compat

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    if compat.available():
        return
    if os.environ.get("CI"):
        raise pytest.UsageError("CI needs the vision extra: pip install -e '.[dev,vision]'")
    skip = pytest.mark.skip(reason="mlx-vlm is not installed (pip install -e '.[vision]')")
    for item in items:
        if HERE in Path(item.fspath).parents:
            item.add_marker(skip)


# Each family's tiny model, written once per session as the fixture `<family>_dir`.
VLM_SEEDS = {"qwen2_vl": 0, "qwen2_5_vl": 0, "gemma3": 1, "smolvlm": 0, "idefics3": 2, "qwen3_vl": 3,
             "mistral3": 5, "pixtral": 6, "qwen3_vl_moe": 7, "glm4v": 8, "glm4v_moe": 9, "idefics2": 10,
             "internvl_chat": 11, "aya_vision": 12,
             "llava_onevision": 13, "kimi_vl": 14,
             "internvl": 15, "kimi_k25": 16, "glm_ocr": 17, "mage_vl": 18,
             "cohere_compass": 19, "muse_glimmer": 20,
             "nemotron_h_nano_omni": 21, "mimo_v2": 22,
             "llmjpvl": 23, "minicpmo": 24, "qwen3_omni_moe": 26, "minimax_m3_vl": 28, "kimi_k3": 29}
VLM_SEEDS.update({"llava": 30, "llava_next": 31, "granite_vision": 32})


def _vlm_dir_fixture(family: str, seed: int):
    @pytest.fixture(scope="session")
    def vlm_dir(tmp_path_factory):
        from mlxkv.vision.tiny_vlm import write_tiny_vlm

        return write_tiny_vlm(tmp_path_factory.mktemp("models") / family, family, seed=seed)

    return vlm_dir


for _family, _seed in VLM_SEEDS.items():
    globals()[f"{_family}_dir"] = _vlm_dir_fixture(_family, _seed)


@pytest.fixture(scope="session")
def qwen2_vl(qwen2_vl_dir):
    """(model, processor) as mlx-vlm loads them."""
    return compat.load(str(qwen2_vl_dir))
