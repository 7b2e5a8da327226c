"""Snapshots of the chat app's screens at a fixed size, with fixed content.

Update them after a deliberate UI change with `pytest tests/tui/test_tui_snapshots.py --snapshot-update`
and look at the report before committing.
"""

from __future__ import annotations

import pytest

from mlxkv.host.engine_thread import EngineEvent
from mlxkv.models.fetch import DEFAULT_CHAT_MODEL
from mlxkv.tui.app import ChatApp
from mlxkv.tui.store import ChatStore, Message
from mlxkv.tui.widgets.prompt_input import PromptInput
from tui_support import ScriptedEngine, StuckEngine, fixed_stats, wait_until

pytestmark = pytest.mark.slow  # subprocesses, apps and real terminals

SIZE = (140, 42)


def chat_app(tmp_path, start, model_name: str = "demo") -> ChatApp:
    store = ChatStore(tmp_path / "chats.sqlite3")
    older = store.create("Tides and moons")
    store.add_message(older.id, Message("user", "Why are there two tides a day?"))
    chat = store.create("Paged KV, explained", system_prompt="Answer briefly.")
    for question, reused in (("What is a KV block?", 0), ("And a prefix hit?", 96)):
        stats = fixed_stats(prompt_tokens=120).as_dict() | {"cached_tokens": {"pool": reused, "memory": 0, "disk": 0}}
        store.add_message(chat.id, Message("user", question))
        store.add_message(chat.id, Message("assistant", f"An answer to *{question}*", "stop", stats))
    return ChatApp(start, store, model_name=model_name, cursor_blink=False)


def test_main_screen_after_a_turn(tmp_path, snap_compare):
    app = chat_app(tmp_path, lambda on_event: ScriptedEngine(on_event))

    async def send_one(pilot):
        await wait_until(pilot, lambda: app.chat_screen.engine_ready and not app.chat_screen.replies)
        app.chat_screen.query_one(PromptInput).focus()
        await pilot.press(*"How does the SSD tier help?", "enter")
        await wait_until(pilot, lambda: not app.chat_screen.replies)
        await app.workers.wait_for_complete()

    assert snap_compare(app, terminal_size=SIZE, run_before=send_one)


def test_loading_screen_shows_download_progress(tmp_path, snap_compare):
    events = [EngineEvent("progress", "downloading mlx-community/Qwen2.5-0.5B-Instruct-4bit: 112 / 280 MB", 0.4)]
    app = chat_app(tmp_path, lambda on_event: StuckEngine(on_event, events), DEFAULT_CHAT_MODEL)
    assert snap_compare(app, terminal_size=SIZE)


def test_error_screen_when_the_model_fails_to_load(tmp_path, snap_compare):
    message = ("cannot download mlx-community/Qwen2.5-0.5B-Instruct-4bit and it is not in the Hugging Face "
               "cache (offline). Offline? Use `--model demo` (built in, no download) or a local model "
               "directory: `--model /path/to/mlx-model`")
    app = chat_app(tmp_path, lambda on_event: StuckEngine(on_event, [EngineEvent("failed", message)]),
                   DEFAULT_CHAT_MODEL)
    assert snap_compare(app, terminal_size=SIZE)
