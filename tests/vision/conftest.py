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


@pytest.fixture(scope="session")
def qwen2_vl_dir(tmp_path_factory):
    from mlxkv.vision.tiny_vlm import write_tiny_vlm

    return write_tiny_vlm(tmp_path_factory.mktemp("models") / "qwen2_vl")


@pytest.fixture(scope="session")
def qwen2_5_vl_dir(tmp_path_factory):
    from mlxkv.vision.tiny_vlm import write_tiny_vlm

    return write_tiny_vlm(tmp_path_factory.mktemp("models") / "qwen2_5_vl", "qwen2_5_vl")


@pytest.fixture(scope="session")
def gemma3_dir(tmp_path_factory):
    from mlxkv.vision.tiny_vlm import write_tiny_vlm

    return write_tiny_vlm(tmp_path_factory.mktemp("models") / "gemma3", "gemma3", seed=1)


@pytest.fixture(scope="session")
def qwen2_vl(qwen2_vl_dir):
    """(model, processor) as mlx-vlm loads them."""
    return compat.load(str(qwen2_vl_dir))



@pytest.fixture(scope="session")
def smolvlm_dir(tmp_path_factory):
    from mlxkv.vision.tiny_vlm import write_tiny_vlm

    return write_tiny_vlm(tmp_path_factory.mktemp("models") / "smolvlm", "smolvlm")


@pytest.fixture(scope="session")
def idefics3_dir(tmp_path_factory):
    from mlxkv.vision.tiny_vlm import write_tiny_vlm

    return write_tiny_vlm(tmp_path_factory.mktemp("models") / "idefics3", "idefics3", seed=2)


@pytest.fixture(scope="session")
def qwen3_vl_dir(tmp_path_factory):
    from mlxkv.vision.tiny_vlm import write_tiny_vlm

    return write_tiny_vlm(tmp_path_factory.mktemp("models") / "qwen3_vl", "qwen3_vl", seed=3)



@pytest.fixture(scope="session")
def mistral3_dir(tmp_path_factory):
    from mlxkv.vision.tiny_vlm import write_tiny_vlm

    return write_tiny_vlm(tmp_path_factory.mktemp("models") / "mistral3", "mistral3", seed=5)


@pytest.fixture(scope="session")
def pixtral_dir(tmp_path_factory):
    from mlxkv.vision.tiny_vlm import write_tiny_vlm

    return write_tiny_vlm(tmp_path_factory.mktemp("models") / "pixtral", "pixtral", seed=6)


@pytest.fixture(scope="session")
def qwen3_vl_moe_dir(tmp_path_factory):
    from mlxkv.vision.tiny_vlm import write_tiny_vlm

    return write_tiny_vlm(tmp_path_factory.mktemp("models") / "qwen3_vl_moe", "qwen3_vl_moe", seed=7)


@pytest.fixture(scope="session")
def glm4v_dir(tmp_path_factory):
    from mlxkv.vision.tiny_vlm import write_tiny_vlm

    return write_tiny_vlm(tmp_path_factory.mktemp("models") / "glm4v", "glm4v", seed=8)


@pytest.fixture(scope="session")
def glm4v_moe_dir(tmp_path_factory):
    from mlxkv.vision.tiny_vlm import write_tiny_vlm

    return write_tiny_vlm(tmp_path_factory.mktemp("models") / "glm4v_moe", "glm4v_moe", seed=9)


@pytest.fixture(scope="session")
def idefics2_dir(tmp_path_factory):
    from mlxkv.vision.tiny_vlm import write_tiny_vlm

    return write_tiny_vlm(tmp_path_factory.mktemp("models") / "idefics2", "idefics2", seed=10)
