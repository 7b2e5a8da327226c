"""`mlxkv chat --model demo` in a real terminal: tmux types, capture-pane reads."""

from __future__ import annotations

import os
import re
import shlex
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from real_parts import require

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _tmux():
    require("tmux")


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, check=True).stdout


class Terminal:
    def __init__(self, session: str):
        self.session = session

    def screen(self) -> str:
        return tmux("capture-pane", "-p", "-t", self.session)

    def type(self, text: str) -> None:
        tmux("send-keys", "-t", self.session, "-l", text)
        time.sleep(0.3)  # a person types; the app sees the text before Enter
        tmux("send-keys", "-t", self.session, "Enter")

    def wait_for(self, predicate, what: str, timeout: float = 90.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = self.screen()
            if predicate(screen):
                return screen
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}; the screen was:\n{self.screen()}")


def panel_number(screen: str, label: str) -> int:
    """The number after `label` in the cache panel, or -1 while it is not shown."""
    match = re.search(rf"{label}\s+([\d,]+)", screen)
    return int(match.group(1).replace(",", "")) if match else -1


def mlxkv_command() -> list[str]:
    script = Path(sys.executable).with_name("mlxkv")
    return [str(script)] if script.exists() else [sys.executable, "-m", "mlxkv.cli"]


@pytest.fixture
def terminal(tmp_path):
    session = f"mlxkv-chat-test-{os.getpid()}"
    data = tmp_path / "data"
    env = {"MLXKV_DATA_DIR": str(data), "MLXKV_CACHE_DIR": os.environ["MLXKV_CACHE_DIR"], "TERM": "xterm-256color"}
    command = " ".join(shlex.quote(part) for part in
                       # COLUMNS and LINES (pytest may set them) would override the pane's size.
                       ["env", "-u", "COLUMNS", "-u", "LINES", *(f"{k}={v}" for k, v in env.items()),
                        *mlxkv_command(),
                        "chat", "--model", "demo", "--max-tokens", "40", "--disk-tier", str(tmp_path / "kv")])
    tmux("new-session", "-d", "-s", session, "-x", "150", "-y", "46", f"{command}; echo EXITED $?; sleep 120")
    try:
        yield Terminal(session), data / "chats.sqlite3"
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


def test_chat_in_a_real_terminal(terminal):
    term, db = terminal
    term.wait_for(lambda s: "Block pool:" in s, "the model to load")

    term.type("What is the capital of France?")
    screen = term.wait_for(lambda s: "decode" in s and "tok/s" in s, "the first reply and its stats")
    (reply, stats), = sqlite3.connect(db).execute("SELECT content, stats FROM messages WHERE role = 'assistant'")
    assert "Paris" in reply, reply  # the demo model is a real one (SmolLM2-135M-Instruct): English
    # A word of the reply that fits on one screen line (a longer one wraps).
    word = max(re.findall(r"[A-Za-z]{3,30}", reply), key=len)
    screen = term.wait_for(lambda s: "assistant" in s and word in s, f"the reply ({word!r}) on screen")
    assert panel_number(screen, "prompt tokens") == int(re.search(r'"prompt_tokens": (\d+)', stats).group(1)), screen

    term.type("and then?")
    first_prompt = panel_number(screen, "prompt tokens")
    screen = term.wait_for(lambda s: panel_number(s, "prompt tokens") > first_prompt, "the second reply's stats")
    assert panel_number(screen, "from pool") > 0, screen

    tmux("send-keys", "-t", term.session, "C-q")
    term.wait_for(lambda s: "EXITED 0" in s, "the app to quit", timeout=30)
