"""The real programs some tests drive, and what a missing one means.

On a developer's machine a missing part skips its tests with the line that
installs it. Under CI=true it fails them: a CI machine without npm or redis
must not pass green with none of those tests run.
"""

from __future__ import annotations

import os
import shutil

import pytest

INSTALL = {
    "redis-server": "apt-get install -y redis-server",
    "clang++-19": "apt-get install -y clang-19",
    "valgrind": "apt-get install -y valgrind",
    "tmux": "apt-get install -y tmux",
    "claude": "npm install -g @anthropic-ai/claude-code@2.1.328",
    "codex": "npm install -g @openai/codex@0.169.0",
    "mlx-embeddings": "pip install 'mlxkv[embeddings]'",  # a Python package: find_spec looks it up
}


def on_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def missing_line(name: str) -> str:
    return f"{name} is not installed: {INSTALL[name]} (.ci/run installs it)"


_LOOK_UP = object()


def require(name: str, found=_LOOK_UP) -> str:
    """The part's path (`found`, where the caller looked it up itself; else on PATH by `name`);
    without it a skip, or a failure under CI."""
    if found is _LOOK_UP:
        found = shutil.which(name)
    if found:
        return found
    if on_ci():
        pytest.fail(missing_line(name), pytrace=False)
    pytest.skip(missing_line(name))
