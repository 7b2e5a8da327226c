"""Under CI a missing real part fails its tests; elsewhere it skips them, with the install line either way."""

from __future__ import annotations

import re

import pytest

import real_parts


def outcome(name: str) -> tuple[str, str]:
    """What `require` did, caught here whichever it was: a skip escaping a `pytest.raises(fail)`
    would skip this test rather than fail it."""
    try:
        real_parts.require(name)
    except pytest.skip.Exception as e:
        return "skip", str(e)
    except pytest.fail.Exception as e:
        return "fail", str(e)
    return "returned", ""


def test_a_missing_part_skips_on_a_developer_machine(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setattr(real_parts.shutil, "which", lambda name: None)
    kind, message = outcome("tmux")
    assert kind == "skip" and "apt-get install -y tmux" in message


def test_a_missing_part_fails_under_ci(monkeypatch):
    monkeypatch.setenv("CI", "true")
    monkeypatch.setattr(real_parts.shutil, "which", lambda name: None)
    kind, message = outcome("codex")
    assert kind == "fail" and "npm install -g @openai/codex" in message


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
