"""Finding the chat model: demo, local paths, the Hugging Face cache, downloads with progress."""

from __future__ import annotations

import pytest

from mlxkv.errors import MlxkvError
from mlxkv.models.fetch import DEFAULT_CHAT_MODEL, fetch_model, progress_bar_class


@pytest.fixture
def offline_empty_hub(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))


def test_offline_without_the_default_model_names_demo_and_local_paths(offline_empty_hub):
    reports = []
    with pytest.raises(MlxkvError) as error:
        fetch_model(DEFAULT_CHAT_MODEL, lambda text, fraction: reports.append(text))
    message = str(error.value)
    assert DEFAULT_CHAT_MODEL in message and "--model demo" in message and "/path/to/mlx-model" in message
    assert "\n" not in message
    assert reports == [f"downloading {DEFAULT_CHAT_MODEL}"]


def test_demo_and_local_directories_need_no_hub(offline_empty_hub, llama_dir):
    assert fetch_model(llama_dir, lambda *a: None) == llama_dir
    assert fetch_model("tiny", lambda *a: None).endswith("tiny")
    assert "gguf-SmolLM2-135M-Instruct" in fetch_model("demo", lambda *a: None)
    with pytest.raises(MlxkvError, match="try --model demo"):
        fetch_model("not a model", lambda *a: None)


def test_download_progress_is_reported_in_bytes():
    reports = []
    bar = progress_bar_class("org/model", lambda text, fraction: reports.append((text, fraction)))(
        total=200_000_000, unit="B", mininterval=0)
    bar.update(50_000_000)
    bar.close()
    assert ("downloading org/model: 50 / 200 MB", 0.25) in reports
