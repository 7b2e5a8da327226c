"""The runnable examples run."""

from __future__ import annotations

import pytest

import subprocess
import sys
from pathlib import Path

pytestmark = pytest.mark.slow  # subprocesses, apps and real terminals

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_kv_cache_connector_example_hydrates_from_memory(llama_dir):
    # A tiny model: what the example shows is the tier, and the demo model took a minute here.
    out = subprocess.run([sys.executable, str(EXAMPLES / "kv_cache_connector.py"), "--model", llama_dir],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    last_turn = [l for l in out.stdout.splitlines() if l.startswith("A, turn 2")][0]
    assert "'memory': 0" not in last_turn


def test_kv_cache_connector_example_bad_model_is_one_line(tmp_path):
    out = subprocess.run([sys.executable, str(EXAMPLES / "kv_cache_connector.py"), "--model", str(tmp_path / "none")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"kv_cache_connector.py: error: model not found: '{tmp_path / 'none'}' is not a directory or a "
        "Hugging Face id (try --model demo)"]
