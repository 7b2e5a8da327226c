"""Images in the chat app, driven by a Pilot with a real engine thread on a tiny Qwen2-VL: the
palette's "Attach image", and the cache panel's image line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from textual.command import CommandInput, CommandPalette
from textual.widgets import Input, OptionList
from vision_cases import make_image

from mlxkv.config import CacheConfig
from mlxkv.host.engine_thread import EngineThread
from mlxkv.tui.app import ChatApp, load_chat_engine
from mlxkv.tui.screens.image_path import ImagePathScreen
from mlxkv.tui.store import ChatStore
from mlxkv.tui.widgets.prompt_input import PromptInput
from mlxkv.tui.widgets.turn_stats import TurnStats

sys.path.insert(0, str(Path(__file__).parents[1] / "tui"))
from tui_support import pilot_test, shown, wait_until  # noqa: E402  (tests/tui's helpers)

pytestmark = pytest.mark.slow  # a vision model in a real app
SIZE = (140, 44)


def _app(tmp_path, model_dir):
    cache = CacheConfig(block_size=4, num_blocks=256, disk_tier=str(tmp_path / "kv"))

    def start(on_event):
        return EngineThread(str(model_dir), cache, on_event=on_event, load=load_chat_engine).start()

    store = ChatStore(tmp_path / "chats.sqlite3")
    return ChatApp(start, store, model_name="tiny-vl", generation={"max_tokens": 6}, cursor_blink=False), store


async def _attach(pilot, path: str) -> None:
    """The palette's "Attach image", then the path typed into its prompt."""
    await pilot.press("ctrl+p")
    await wait_until(pilot, lambda: isinstance(pilot.app.screen, CommandPalette), what="the palette")
    pilot.app.screen.query_one(CommandInput).value = "attach"  # as typed (a key a pause): its change starts the search
    await pilot.pause()
    await pilot.app.workers.wait_for_complete()  # the palette's search worker
    await pilot.pause()
    results = pilot.app.screen.query_one(OptionList)
    await wait_until(pilot, lambda: results.option_count and results.highlighted is not None)
    assert "Attach image" in str(results.get_option_at_index(results.highlighted).prompt)
    await pilot.press("enter")
    await wait_until(pilot, lambda: isinstance(pilot.app.screen, ImagePathScreen), what="the path prompt")
    pilot.app.screen.query_one(Input).value = path
    await pilot.press("enter")
    await wait_until(pilot, lambda: not isinstance(pilot.app.screen, ImagePathScreen), what="the prompt to close")


async def _send(pilot, text: str) -> None:
    """Type `text` after what the box holds, send it, and wait for the reply's turn in the panel."""
    screen = pilot.app.chat_screen
    panel, before = screen.query_one(TurnStats), screen.query_one(TurnStats).stats
    prompt = screen.query_one(PromptInput)
    prompt.focus()
    prompt.move_cursor(prompt.document.end)
    prompt.insert(text)  # typed keys take a pause each; Enter is pressed
    await pilot.press("enter")
    await wait_until(pilot, lambda: panel.stats is not before and not screen.replies, what="the reply to end")
    await pilot.app.workers.wait_for_complete()


@pilot_test
async def test_an_image_attached_from_the_palette_is_sent_and_the_panel_shows_its_tokens(tmp_path, qwen2_vl_dir):
    make_image().save(tmp_path / "a picture.png")  # a space: the line quotes it
    app, store = _app(tmp_path, qwen2_vl_dir)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await wait_until(pilot, lambda: app.chat_screen.engine_ready, what="the model to load")
        await _attach(pilot, str(tmp_path / "missing.png"))
        assert any("/image: no such file" in n.message for n in app._notifications)
        prompt = app.chat_screen.query_one(PromptInput)
        assert prompt.text == ""
        await _attach(pilot, str(tmp_path / "a picture.png"))
        assert prompt.text == f"/image '{tmp_path / 'a picture.png'}'"
        await _send(pilot, "\nWhat is it?")
        panel = app.chat_screen.query_one(TurnStats)
        assert "image: 12 tokens, computed" in shown(panel)
        assert panel.stats["image_tokens"] == 12 and panel.stats["cached_image_tokens"] == 0
        await _send(pilot, "And now?")  # the first turn, its image too, is a prefix hit
        assert "image: 12 tokens, cached" in shown(panel)
        user = [m for m in store.messages(store.conversations()[0].id) if m.role == "user"]
        assert user[0].content.startswith("/image '") and user[0].content.endswith("What is it?")
