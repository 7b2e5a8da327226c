"""Conversations in SQLite, in the user data dir, with a schema version.

The schema version is SQLite's `user_version`; `MIGRATIONS[i]` takes a
database from version i to i + 1, so an older file is upgraded in place
and a newer one (from a later mlxkv) is refused rather than damaged.
"""

from __future__ import annotations

import json
import sqlite3
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from mlxkv.chat.image_command import content_parts
from mlxkv.errors import MlxkvError
from mlxkv.system.paths import data_dir
from mlxkv.system.private_files import make_private_dirs, private_file
from mlxkv.chat.reply_tokens import is_token_list

MIGRATIONS = [
    """
    CREATE TABLE conversations (
        id INTEGER PRIMARY KEY,
        title TEXT NOT NULL,
        system_prompt TEXT NOT NULL DEFAULT '',
        model TEXT NOT NULL DEFAULT '',
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL
    );
    CREATE TABLE messages (
        id INTEGER PRIMARY KEY,
        conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        role TEXT NOT NULL,
        content TEXT NOT NULL,
        finish_reason TEXT,
        stats TEXT,
        created_at REAL NOT NULL
    );
    CREATE INDEX messages_by_conversation ON messages(conversation_id, id);
    """,
    # AUTOINCREMENT: a deleted chat's id is never given to a new one. With
    # ids reused, a reply still streaming into a chat deleted (here, or in
    # another window) was saved into the next new chat, which got its id.
    # SQLite adds AUTOINCREMENT only by rebuilding the table; foreign keys
    # are off meanwhile, so dropping the old table keeps the messages.
    """
    CREATE TABLE conversations_v2 (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        title TEXT NOT NULL,
        system_prompt TEXT NOT NULL DEFAULT '',
        model TEXT NOT NULL DEFAULT '',
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL
    );
    INSERT INTO conversations_v2 (id, title, system_prompt, model, created_at, updated_at)
        SELECT id, title, system_prompt, model, created_at, updated_at FROM conversations;
    DROP TABLE conversations;
    ALTER TABLE conversations_v2 RENAME TO conversations;
    """,
    # A reply's token ids as generated (a JSON list), sent back with its
    # text so the next turn's prompt is the one the KV cache holds
    # (mlxkv/reply_tokens.py). Older replies have none and are sent as text.
    """
    ALTER TABLE messages ADD COLUMN tokens TEXT;
    """,
]
SCHEMA_VERSION = len(MIGRATIONS)


def default_db_path() -> Path:
    return data_dir() / "chats.sqlite3"


@dataclass
class Conversation:
    id: int
    title: str
    system_prompt: str = ""
    model: str = ""
    updated_at: float = 0.0


@dataclass
class Message:
    role: str
    content: str
    finish_reason: str | None = None
    stats: dict | None = None
    tokens: list[int] | None = None  # a reply's ids as generated


class ChatStore:
    """Conversations and their messages. Use it from one thread (the UI's)."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path is not None else default_db_path()
        try:
            if str(self.path) != ":memory:":
                # A person's conversations: readable by them alone. SQLite
                # gives its journal files the database file's mode.
                make_private_dirs(self.path.parent)
                private_file(self.path)
            self.db = sqlite3.connect(self.path)
            self._migrate()  # before foreign keys are on: a migration may rebuild a table
            self.db.execute("PRAGMA foreign_keys = ON")
        except OSError as e:  # the data directory is a file, or cannot be made
            raise MlxkvError(f"cannot open the chat database {self.path}: {e.strerror or e}") from None
        except sqlite3.DatabaseError as e:
            raise MlxkvError(f"cannot open the chat database {self.path}: {e}") from None

    def _migrate(self) -> None:
        version = self.db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise MlxkvError(
                f"the chat database {self.path} has schema version {version}, newer than this "
                f"mlxkv's {SCHEMA_VERSION}; upgrade mlxkv or set MLXKV_DATA_DIR to another directory"
            )
        for target, script in enumerate(MIGRATIONS[version:], start=version + 1):
            with self.db:
                self.db.executescript(f"BEGIN; {script}; PRAGMA user_version = {target}; COMMIT;")

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def _writing(self):
        """One write transaction. A write that fails (disk full, an I/O error,
        a read-only file) is an MlxkvError the app can show, not a crash."""
        try:
            with self.db:
                yield
        except sqlite3.Error as e:
            raise MlxkvError(f"cannot save to the chat database {self.path}: {e}") from None

    # -- conversations ----------------------------------------------------

    def create(self, title: str = "New chat", system_prompt: str = "", model: str = "") -> Conversation:
        now = time.time()
        with self._writing():
            cur = self.db.execute(
                "INSERT INTO conversations (title, system_prompt, model, created_at, updated_at) "
                "VALUES (?, ?, ?, ?, ?)",
                (title, system_prompt, model, now, now),
            )
        return Conversation(cur.lastrowid, title, system_prompt, model, now)

    def conversations(self) -> list[Conversation]:
        """All conversations, most recently used first."""
        rows = self.db.execute(
            "SELECT id, title, system_prompt, model, updated_at FROM conversations "
            "ORDER BY updated_at DESC, id DESC"
        )
        return [Conversation(*row) for row in rows]

    def most_recent(self, new_title: str) -> Conversation:
        """The most recently used chat, or a new one (titled `new_title`) when there is none."""
        found = self.conversations()
        return found[0] if found else self.create(new_title)

    def get(self, conversation_id: int) -> Conversation | None:
        row = self.db.execute(
            "SELECT id, title, system_prompt, model, updated_at FROM conversations WHERE id = ?",
            (conversation_id,),
        ).fetchone()
        return Conversation(*row) if row else None

    def rename(self, conversation_id: int, title: str) -> None:
        with self._writing():
            self.db.execute("UPDATE conversations SET title = ? WHERE id = ?", (title, conversation_id))

    def set_system_prompt(self, conversation_id: int, system_prompt: str) -> None:
        with self._writing():
            self.db.execute(
                "UPDATE conversations SET system_prompt = ? WHERE id = ?", (system_prompt, conversation_id)
            )

    def set_model(self, conversation_id: int, model: str) -> None:
        """The conversation goes on with `model`. When it had another, its replies' token ids are
        that model's (its tokenizer's): they are dropped, and the replies go back as text. A chat
        saved with no model (before chats remembered theirs) keeps them: they are the one model's."""
        row = self.db.execute("SELECT model FROM conversations WHERE id = ?", (conversation_id,)).fetchone()
        if row is None or row[0] == model:
            return
        with self._writing():
            self.db.execute("UPDATE conversations SET model = ? WHERE id = ?", (model, conversation_id))
            if row[0]:
                self.db.execute("UPDATE messages SET tokens = NULL WHERE conversation_id = ?", (conversation_id,))

    def delete(self, conversation_id: int) -> None:
        with self._writing():
            self.db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    # -- messages ---------------------------------------------------------

    def add_message(self, conversation_id: int, message: Message) -> int:
        """Append `message`; returns its id."""
        now = time.time()
        stats = json.dumps(message.stats) if message.stats is not None else None
        tokens = json.dumps(message.tokens) if message.tokens else None
        with self._writing():
            cur = self.db.execute(
                "INSERT INTO messages (conversation_id, role, content, finish_reason, stats, tokens, created_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (conversation_id, message.role, message.content, message.finish_reason, stats, tokens, now),
            )
            self.db.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (now, conversation_id))
        return cur.lastrowid

    def delete_message(self, message_id: int) -> None:
        with self._writing():
            self.db.execute("DELETE FROM messages WHERE id = ?", (message_id,))

    def messages(self, conversation_id: int) -> list[Message]:
        rows = self.db.execute(
            "SELECT role, content, finish_reason, stats, tokens FROM messages WHERE conversation_id = ? ORDER BY id",
            (conversation_id,),
        )
        return [Message(role, content, finish, json.loads(stats) if stats else None, _ids(tokens))
                for role, content, finish, stats, tokens in rows]

    def prompt_messages(self, conversation_id: int) -> list[dict]:
        """The chat-template messages: the system prompt (if any), then the turns."""
        conversation = self.get(conversation_id)
        head = [{"role": "system", "content": conversation.system_prompt}] if conversation.system_prompt else []
        return head + [_prompt_message(m) for m in self.messages(conversation_id)]


def _prompt_message(m: Message) -> dict:
    # A user message led by `/image PATH` lines carries those images (chat/image_command.py).
    message = {"role": m.role, "content": content_parts(m.content) if m.role == "user" else m.content}
    if m.tokens:
        message["tokens"] = m.tokens
    return message


def _ids(stored: str | None) -> list[int] | None:
    """Stored token ids; None for none, or for a value that is not a list of ids (the text is sent then)."""
    try:
        ids = json.loads(stored) if stored else None
    except ValueError:
        return None
    return ids if is_token_list(ids) and ids else None
