"""The README's promises: its Python example runs as written, and its main
command prints what the README says it prints."""

from __future__ import annotations

import pytest

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

pytestmark = pytest.mark.slow  # subprocesses, apps and real terminals

README = Path(__file__).resolve().parents[2] / "README.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), re.S)


def test_the_python_example_runs(tmp_path):
    (example,) = blocks("python")
    done = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()


def test_the_main_command_shows_a_prefix_hit_on_its_second_prompt():
    main = next(b for b in blocks("sh") if "mlxkv generate" in b)
    words = shlex.split(main.replace("\\\n", " "))
    argv = words[words.index("generate") + 1:]  # after the install
    done = subprocess.run([sys.executable, "-m", "mlxkv.cli", "generate", *argv], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(rows) == 2
    assert rows[0]["cached_tokens"]["pool"] == 0 and rows[1]["cached_tokens"]["pool"] == 16
