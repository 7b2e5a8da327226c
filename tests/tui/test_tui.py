"""The chat app driven by a Pilot, with a real engine thread on a tiny model."""

from __future__ import annotations

import pytest

import json
import shutil
import sys
import time

from mlxkv.config import CacheConfig
from mlxkv.models.tiny import TinyModelSpec, write_tiny_model
from mlxkv.host.engine_thread import EngineThread
from mlxkv.tui import app as app_module
from mlxkv.tui.app import ChatApp, load_chat_engine
from mlxkv.tui.messages import ReplyDelta
from mlxkv.tui.screens.error import ErrorScreen
from mlxkv.tui.store import ChatStore
from mlxkv.tui.widgets.message_view import MessageView
from mlxkv.tui.widgets.prompt_input import PromptInput
from mlxkv.tui.widgets.tier_table import TierTable
from mlxkv.tui.widgets.turn_stats import TurnStats
from textual.command import CommandPalette
from textual.widgets import OptionList
from tui_support import pilot_test, shown, wait_until

pytestmark = pytest.mark.slow  # subprocesses, apps and real terminals

SIZE = (140, 44)


def make_app(tmp_path, model, max_tokens=48, num_blocks=512, disk_tier=None, model_name="tiny", others=None):
    """The app on `model` (as `model_name`); `others`: more models the palette switches to, {name: source}."""
    cache = CacheConfig(block_size=8, num_blocks=num_blocks, disk_tier=str(disk_tier or tmp_path / "kv"))

    def starter(source):
        return lambda on_event: EngineThread(source, cache, on_event=on_event, load=load_chat_engine).start()

    store = ChatStore(tmp_path / "chats.sqlite3")
    app = ChatApp(starter(model), store, model_name=model_name, generation={"max_tokens": max_tokens},
                  cursor_blink=False, models={name: starter(source) for name, source in (others or {}).items()})
    return app, store


async def send(pilot, text: str) -> None:
    prompt = pilot.app.screen.query_one(PromptInput)
    prompt.focus()
    await pilot.press(*text)
    await pilot.press("enter")


def assistant_views(app) -> list[MessageView]:
    return [v for v in app.chat_screen.query(MessageView) if v.role == "assistant"]


def turn(app) -> TurnStats:
    return app.chat_screen.query_one(TurnStats)


async def ready(pilot) -> None:
    await wait_until(pilot, lambda: pilot.app.chat_screen.engine_ready, what="the model to load")


def stream_slowly(app, seconds_per_step: float = 0.01) -> None:
    """Make the next reply outlast the test's steps, on any machine.

    A random-weight model may say EOS at once, and on a fast machine the
    tiny model writes 3000 tokens before a loaded CI runner's UI gets to
    press Esc. With no EOS and a floor on each engine step, 3000 tokens
    take at least 30 s; the sleep releases the GIL, so the UI is not slowed.
    """
    def slow(engine):
        engine.tokenizer.eos_token_ids.clear()
        forward = engine.runner.forward

        def slowed(*args, **kwargs):
            time.sleep(seconds_per_step)
            return forward(*args, **kwargs)

        engine.runner.forward = slowed

    app.engine.call(slow).result(10)


def error_shown(app) -> str:
    """The error screen's message once it is composed; "" before. The screen
    is current a moment before its widgets exist (a NoMatches, now and then)."""
    if not isinstance(app.screen, ErrorScreen):
        return ""
    found = app.screen.query("#error-message")
    return shown(found.first()) if found else ""


async def reply_done(pilot) -> None:
    await wait_until(pilot, lambda: not pilot.app.chat_screen.replies, what="the reply to end")
    await pilot.app.workers.wait_for_complete()


@pilot_test
async def test_reply_streams_in_and_the_second_message_reuses_the_first(tmp_path, llama_dir):
    app, store = make_app(tmp_path, llama_dir, max_tokens=400)
    deltas = []

    def spy(message):
        if isinstance(message, ReplyDelta) and not any(m is message for m in deltas):
            deltas.append(message)

    async with app.run_test(size=SIZE, message_hook=spy) as pilot:
        await ready(pilot)
        await send(pilot, "hello there")
        await reply_done(pilot)
        final = assistant_views(app)[-1].text
        assert len(deltas) >= 2 and "".join(m.text for m in deltas) == final, "the reply did not stream in"
        first = turn(app).stats
        assert first["prompt_tokens"] > 0 and first["decode_tokens_per_s"] > 0
        first_deltas = len(deltas)

        await send(pilot, "and then?")
        await reply_done(pilot)
        second = turn(app).stats
        assert second["cached_tokens"]["pool"] > 0
        pool_line = next(line for line in shown(turn(app)).splitlines() if "from pool" in line)
        assert f"{second['cached_tokens']['pool']:,}" in pool_line.split()  # the panel shows the reuse
        messages = store.messages(app.chat_screen.conversation_id)
        assert [m.role for m in messages] == ["user", "assistant", "user", "assistant"]
        assert messages[1].content == final and messages[3].stats["cached_tokens"]["pool"] > 0
        # The reply was kept with its ids and sent back with them, so the
        # second turn reused all of the first, reply and all.
        ids = [i for m in deltas[: first_deltas] for i in m.ids]
        assert messages[1].tokens == ids and len(ids) == first["generation_tokens"]
        read = first["prompt_tokens"] + len(ids) - 1  # less the last token, never read
        assert second["cached_tokens"]["pool"] >= (read - 1) // 8 * 8 > first["prompt_tokens"]


async def second_turn_reuses_the_first(tmp_path, spec: TinyModelSpec) -> None:
    """Two turns in the app on a model of `spec`: the second reuses the first, prompt and reply,
    and the cache panel shows it."""
    model = str(write_tiny_model(tmp_path / spec.family, spec))
    app, _ = make_app(tmp_path, model, max_tokens=40)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "hello there, sea")
        await reply_done(pilot)
        first = turn(app).stats
        await send(pilot, "and then?")
        await reply_done(pilot)
        second = turn(app).stats
        read = first["prompt_tokens"] + first["generation_tokens"] - 1
        assert second["cached_tokens"]["pool"] >= (read - 1) // 8 * 8 > first["prompt_tokens"] // 2
        pool_line = next(line for line in shown(turn(app)).splitlines() if "from pool" in line)
        assert f"{second['cached_tokens']['pool']:,}" in pool_line.split()


@pilot_test
async def test_a_sliding_window_model_chats_and_its_second_turn_reuses_the_first(tmp_path):
    """Gemma 3's layout, its window of 16 tokens wrapped by every turn: no new flag."""
    await second_turn_reuses_the_first(tmp_path, TinyModelSpec(family="gemma3_text", sliding_window=16, seed=9))


@pilot_test
async def test_a_hybrid_model_chats_and_its_second_turn_resumes_from_a_checkpoint(tmp_path):
    """Qwen3-Next's layout (gated delta net and attention): the checkpoint hit counts as reuse."""
    await second_turn_reuses_the_first(tmp_path, TinyModelSpec(family="qwen3_next", seed=9))


@pilot_test
async def test_escape_mid_reply_keeps_the_partial_reply_and_the_app_usable(tmp_path, llama_dir):
    app, store = make_app(tmp_path, llama_dir, max_tokens=3000)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        stream_slowly(app)
        await send(pilot, "a long story please")
        await wait_until(pilot, lambda: assistant_views(app) and assistant_views(app)[-1].text, what="text")
        await pilot.press("escape")
        await reply_done(pilot)
        view = assistant_views(app)[-1]
        assert view.border_subtitle == "stopped"
        kept = store.messages(app.chat_screen.conversation_id)[-1]
        assert kept.finish_reason == "cancelled" and kept.content == view.text != ""
        assert kept.stats["generation_tokens"] < 3000
        pool = app.engine.call(lambda engine: engine.stats()["pool"]).result(10)
        assert pool["in_use"] == 0

        app.generation["max_tokens"] = 8
        await send(pilot, "short one")
        await reply_done(pilot)
        assert store.messages(app.chat_screen.conversation_id)[-1].finish_reason == "length"
        assert app.chat_screen.query_one(PromptInput).has_focus


@pilot_test
async def test_reopening_a_chat_after_a_restart_loads_its_prefix_from_the_ssd_tier(tmp_path, llama_dir):
    app, store = make_app(tmp_path, llama_dir, max_tokens=64)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "tell me about the sea and the ships that sail on it")
        await reply_done(pilot)
    store.close()  # the app closed the engine, which finished its SSD writes

    app, store = make_app(tmp_path, llama_dir, max_tokens=64)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await wait_until(pilot, lambda: turn(app).kind == "prefill", what="the reopened chat's prefill")
        stats = turn(app).stats
        # A new process: nothing in the pool or the memory tier; the prefix
        # comes from SSD, the reply too (it is sent back as the ids it was).
        reply = store.messages(app.chat_screen.conversation_id)[-1]
        read = stats["prompt_tokens"] - 4  # "<|im_end|>\n<|im_start|>assistant\n" follow the reply
        assert reply.tokens and stats["cached_tokens"]["disk"] >= (read - 1) // 8 * 8
        assert stats["cached_tokens"]["pool"] == 0
        assert stats["cached_tokens"]["memory"] == 0
        assert "from SSD tier" in shown(turn(app))
        assert len(assistant_views(app)) == 1


@pilot_test
async def test_a_reply_streams_on_while_another_chat_is_opened_and_its_prefix_hydrated(tmp_path, llama_dir):
    app, store = make_app(tmp_path, llama_dir, max_tokens=16)
    async with app.run_test(size=SIZE) as pilot:  # chats B, then A, each with one exchange
        await ready(pilot)
        await send(pilot, "tell me about the sea and the ships that sail on it")
        await reply_done(pilot)
        chat_b = app.chat_screen.conversation_id
        await pilot.press("ctrl+n")
        await send(pilot, "and now something about mountains and the snow on them")
        await reply_done(pilot)
        chat_a = app.chat_screen.conversation_id
    store.close()

    # A new process: A (most recent) opens first; B's prefix is only on SSD.
    app, store = make_app(tmp_path, llama_dir, max_tokens=3000)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.chat_screen
        await ready(pilot)
        await reply_done(pilot)  # A's own prefill
        assert screen.conversation_id == chat_a
        stream_slowly(app)
        await send(pilot, "a long story please")
        await wait_until(pilot, lambda: screen.reply is not None and screen.reply.tokens > 0, what="A's reply")
        streaming = screen.reply

        await screen.open_conversation(chat_b)
        await wait_until(pilot, lambda: turn(app).kind == "prefill" and turn(app).stats["cached_tokens"]["disk"],
                         what="B's prefix to come back from the SSD tier")
        assert screen.reply is None and streaming.id in screen.replies, "A's reply is still streaming"
        at_switch = streaming.tokens
        await wait_until(pilot, lambda: streaming.tokens > at_switch, what="A's reply to stream on")

        await screen.open_conversation(chat_a)  # back to A: the reply so far, still growing
        view = assistant_views(app)[-1]
        assert screen.reply is streaming and view is streaming.view and view.text
        shown_at = len(view.text)
        await wait_until(pilot, lambda: len(view.text) > shown_at, what="the reply to stream into A's view")
        await pilot.press("escape")
        await reply_done(pilot)
        kept = store.messages(chat_a)[-1]
        assert kept.finish_reason == "cancelled" and kept.content == view.text
        assert at_switch < kept.stats["generation_tokens"] < 3000
        assert [m.role for m in store.messages(chat_b)] == ["user", "assistant"]


@pilot_test
async def test_a_model_that_fails_to_load_shows_an_error_screen(tmp_path):
    for name in ("no-such-model", "[/]x"):  # a name is text: read as markup, "[/]" crashed two screens
        app, _ = make_app(tmp_path, str(tmp_path / name), model_name=name)
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: "model not found" in error_shown(app), what="the error screen")
            assert name in shown(app.screen.query_one("#error-title"))
            await pilot.press("q")
        assert app.return_code == 2


@pilot_test
async def test_every_way_out_of_the_error_screen_exits_2(tmp_path):
    ways = {"q": ["q"], "Esc": ["escape"], "Ctrl+Q": ["ctrl+q"], "the palette's Quit": ["ctrl+p", *"quit"]}
    for way, keys in ways.items():
        app, _ = make_app(tmp_path, str(tmp_path / "missing"), model_name="missing")
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: "model not found" in error_shown(app), what="the error screen")
            await pilot.press(*keys)
            if way == "the palette's Quit":
                await pilot.pause(0.5)  # the palette's search runs in a worker
                await pilot.press("enter")
            await wait_until(pilot, lambda: app.return_code is not None, what=f"{way} to quit")
        assert app.return_code == 2, way


@pilot_test
async def test_a_model_without_a_chat_template_shows_an_error_screen(tmp_path, llama_dir):
    base = tmp_path / "base-model"  # a base model: every message would be refused
    shutil.copytree(llama_dir, base)
    tokenizer_config = json.loads((base / "tokenizer_config.json").read_text())
    del tokenizer_config["chat_template"]
    (base / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    app, _ = make_app(tmp_path, str(base), model_name="base-model")
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: "has no chat template" in error_shown(app), what="the error screen")
        await pilot.press("q")
    assert app.return_code == 2


@pilot_test
async def test_an_unusable_ssd_tier_is_shown_as_off_with_the_reason(tmp_path, llama_dir):
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("")
    app, _ = make_app(tmp_path, llama_dir, disk_tier=not_a_dir)

    def toasts() -> str:
        return "\n".join(shown(toast) for toast in app.screen.query("Toast"))

    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await ready(pilot)
        await wait_until(pilot, lambda: "SSD tier disabled" in toasts(), what="a notification")
        assert "Not a directory" in toasts()
        ssd_row = next(line for line in str(app.chat_screen.query_one(TierTable).render()).splitlines() if "SSD" in line)
        assert ssd_row.split() == ["SSD", "off"]
        await send(pilot, "still chatting")  # the app works on without the tier
        await reply_done(pilot)
        assert assistant_views(app)[-1].text


def test_the_app_runs_with_a_short_gil_switch_interval(monkeypatch, tmp_path):
    # The engine thread wins the GIL back from the UI thread at most one
    # switch interval after asking; the default 5 ms is several decode steps.
    seen = []
    monkeypatch.setattr(app_module.ChatApp, "run", lambda self: seen.append(sys.getswitchinterval()))
    before = sys.getswitchinterval()
    assert app_module.run([("demo", "demo")], CacheConfig(), max_tokens=8, temperature=0.0) == 0
    assert seen == [app_module.UI_SWITCH_INTERVAL_S] and app_module.UI_SWITCH_INTERVAL_S < before
    assert sys.getswitchinterval() == before  # the process's own setting comes back


async def palette(pilot, command: str) -> None:
    """Run `command` from the command palette, as a user does: Ctrl+P, type it, Enter."""
    await pilot.press("ctrl+p")
    await wait_until(pilot, lambda: isinstance(pilot.app.screen, CommandPalette), what="the palette")
    await pilot.press(*command)
    hits = pilot.app.screen.query_one(OptionList)
    await wait_until(pilot, lambda: hits.option_count and hits.highlighted is not None
                     and str(hits.get_option_at_index(hits.highlighted).prompt).splitlines()[0] == command,
                     what=command)
    await pilot.press("enter")


@pilot_test
async def test_the_palette_switches_models_and_each_chat_reopens_on_its_own(tmp_path, llama_dir, model_dirs):
    others = {"qwen": model_dirs["qwen2"]}
    app, store = make_app(tmp_path, llama_dir, max_tokens=4, model_name="llama", others=others)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "hello there")
        await reply_done(pilot)
        first = app.chat_screen.conversation_id
        assert store.get(first).model == "llama" and store.messages(first)[-1].tokens
        await pilot.press("ctrl+n")
        await wait_until(pilot, lambda: app.chat_screen.conversation_id != first, what="the new chat")
        second = app.chat_screen.conversation_id
        await palette(pilot, "Switch model: qwen")
        await wait_until(pilot, lambda: app.model_name == "qwen" and app.chat_screen.engine_ready,
                         what="qwen to load")
        assert store.get(second).model == "qwen" and app.chat_screen.title == "mlxkv chat · qwen"
        await palette(pilot, f"Open chat: {store.get(first).title}")  # back to the llama's chat: the llama loads
        await wait_until(pilot, lambda: app.model_name == "llama" and app.chat_screen.engine_ready,
                         what="the llama to load again")
        assert store.get(first).model == "llama" and store.messages(first)[-1].tokens  # its ids still the llama's
    store.close()

    app, store = make_app(tmp_path, llama_dir, max_tokens=4, model_name="llama", others=others)
    async with app.run_test(size=SIZE) as pilot:  # reopened: the most recent chat, the qwen's, on the qwen
        await wait_until(pilot, lambda: app.model_name == "qwen" and app.chat_screen.engine_ready,
                         what="the reopened chat's model")
        assert app.chat_screen.conversation_id == second
    store.close()
