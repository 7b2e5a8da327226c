"""Under CI a missing real part fails its tests; elsewhere it skips them, with the install line either way."""

from __future__ import annotations

import re

import pytest

import real_parts


def test_a_missing_part_skips_on_a_developer_machine(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setattr(real_parts.shutil, "which", lambda name: None)
    with pytest.raises(pytest.skip.Exception, match="apt-get install -y tmux"):
        real_parts.require("tmux")


def test_a_missing_part_fails_under_ci(monkeypatch):
    monkeypatch.setenv("CI", "true")
    monkeypatch.setattr(real_parts.shutil, "which", lambda name: None)
    with pytest.raises(pytest.fail.Exception, match="npm install -g @openai/codex"):
        real_parts.require("codex")


def test_a_present_part_is_its_path(monkeypatch):
    monkeypatch.setenv("CI", "true")
    assert real_parts.require("redis-server", "/usr/bin/redis-server") == "/usr/bin/redis-server"


def test_every_part_ci_installs_is_known():
    """.ci/run installs what these lines say; a part added to one must be added to the other."""
    from pathlib import Path

    ci = (Path(__file__).resolve().parents[1] / ".ci" / "run").read_text()
    extras = re.search(r"pip install -q -e '\.\[([\w,]+)\]'", ci).group(1).split(",")
    for line in real_parts.INSTALL.values():
        package = line.split()[-1]
        extra = re.fullmatch(r"'mlxkv\[(\w+)\]'", package)  # one of mlxkv's own extras
        assert extra.group(1) in extras if extra else package in ci, package
