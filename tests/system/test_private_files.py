"""A person's chats, logs and KV cache are readable by them alone, whatever the umask."""

from __future__ import annotations

import logging
import os
import stat

import pytest

from mlxkv.system import logs
from mlxkv.system.private_files import make_private_dirs, private_file
from mlxkv.tui.store import ChatStore


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def open_umask():
    old = os.umask(0o000)  # the worst case: everything created world-writable
    yield
    os.umask(old)


def test_the_chat_database_and_its_directory_are_private(tmp_path, open_umask):
    store = ChatStore(tmp_path / "data" / "mlxkv" / "chats.sqlite3")
    store.db.execute("CREATE TABLE probe (x)")  # a write: journal files come and go
    store.db.commit()
    assert mode(tmp_path / "data") == mode(tmp_path / "data" / "mlxkv") == 0o700
    assert mode(tmp_path / "data" / "mlxkv" / "chats.sqlite3") == 0o600


def test_an_existing_readable_database_is_made_private_and_keeps_its_chats(tmp_path, open_umask):
    path = tmp_path / "chats.sqlite3"
    ChatStore(path).create("kept")
    os.chmod(path, 0o644)  # as an older mlxkv left it
    store = ChatStore(path)
    assert mode(path) == 0o600
    assert [c.title for c in store.conversations()] == ["kept"]


def test_the_log_file_is_private(tmp_path, open_umask):
    path = tmp_path / "logs" / "mlxkv.log"
    handler = logs.log_to_file(path)
    try:
        logging.getLogger("mlxkv.test").warning("hello")
        handler.flush()
    finally:
        logs.detach(handler)
    assert mode(path.parent) == 0o700 and mode(path) == 0o600
    assert "hello" in path.read_text()


def test_a_file_on_a_read_only_mount_keeps_working(tmp_path, monkeypatch):
    path = tmp_path / "f"
    path.write_text("x")
    os.chmod(path, 0o644)

    def refuse(*args):
        raise PermissionError("not ours")

    monkeypatch.setattr(os, "chmod", refuse)
    assert private_file(path) == path and path.read_text() == "x"


def test_made_directories_are_private_even_nested(tmp_path, open_umask):
    make_private_dirs(tmp_path / "a" / "b" / "c")
    assert {mode(tmp_path / p) for p in ("a", "a/b", "a/b/c")} == {0o700}
