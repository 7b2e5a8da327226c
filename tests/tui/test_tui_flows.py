"""The chat app's own behaviour, on a scripted engine: keys, palette, chats, scrolling."""

from __future__ import annotations

import asyncio

import inspect
import sqlite3

import pytest

import mlxkv.tui.app
import mlxkv.tui.screens.chat
import mlxkv.tui.screens.confirm
import mlxkv.tui.screens.error
import mlxkv.tui.screens.image_path
import mlxkv.tui.screens.rename
import mlxkv.tui.screens.system_prompt
import mlxkv.tui.widgets.prompt_input
from textual import events
from textual.command import CommandPalette
from textual.geometry import Region
from textual.widgets import OptionList

from mlxkv.errors import MlxkvError
from mlxkv.engine.records import GenerationChunk
from mlxkv.host.engine_thread import EngineEvent
from mlxkv.tui.app import ChatApp
from mlxkv.tui.screens.chat import NEW_CHAT_TITLE
from mlxkv.tui.screens.confirm import ConfirmScreen
from mlxkv.tui.screens.rename import RenameScreen
from mlxkv.tui.screens.system_prompt import SystemPromptScreen
from mlxkv.tui.store import MIGRATIONS, SCHEMA_VERSION, ChatStore, Message
from mlxkv.tui.widgets.chat_log import ChatLog
from mlxkv.tui.widgets.conversation_list import ConversationList
from mlxkv.tui.widgets.message_view import MessageView, printable
from mlxkv.tui.widgets.prompt_input import PromptInput
from tui_support import ScriptedEngine, StuckEngine, fixed_stats, pilot_test, shown, wait_until

pytestmark = pytest.mark.slow  # subprocesses, apps and real terminals

SIZE = (120, 40)


def make_app(tmp_path, **engine_options):
    store = ChatStore(tmp_path / "chats.sqlite3")
    engines = []

    def start(on_event):
        engines.append(ScriptedEngine(on_event, **engine_options))
        return engines[-1]

    app = ChatApp(start, store, model_name="scripted", cursor_blink=False)
    return app, store, engines


async def type_and_send(pilot, text):
    pilot.app.chat_screen.query_one(PromptInput).focus()
    await pilot.press(*text, "enter")


async def send_first(pilot, engines, text):
    """Send a chat's first message to a scripted engine; its request's handle."""
    await type_and_send(pilot, text)
    await wait_until(pilot, lambda: engines[0].handles, what="the request")
    return engines[0].handles[0]


async def two_chats(pilot, first, second):
    """Send `first`, then `second` in a new chat; both replies done."""
    await type_and_send(pilot, first)
    await idle(pilot)
    await pilot.press("ctrl+n")
    await type_and_send(pilot, second)
    await idle(pilot)


async def run_command(pilot, search: str) -> str:
    """Search the command palette and run the best match; returns what that match said."""
    await pilot.press("ctrl+p")
    await wait_until(pilot, lambda: isinstance(pilot.app.screen, CommandPalette), what="the palette")
    await pilot.press(*search)
    results = pilot.app.screen.query_one(OptionList)
    await wait_until(pilot, lambda: results.option_count and results.highlighted is not None)
    shown = str(results.get_option_at_index(results.highlighted).prompt)
    await pilot.press("enter")
    return shown


async def idle(pilot):
    await wait_until(pilot, lambda: not pilot.app.chat_screen.replies, what="replies to end")
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()


@pilot_test
async def test_enter_sends_and_shift_enter_makes_a_new_line(tmp_path):
    app, store, engines = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        prompt = app.chat_screen.query_one(PromptInput)
        prompt.focus()
        await pilot.press("h", "i", "shift+enter", "y", "o", "ctrl+j", "u")
        assert prompt.text == "hi\nyo\nu" and not engines[0].requests
        await pilot.press("enter")
        await idle(pilot)
        assert prompt.text == ""
        messages, options = engines[0].requests[0]
        assert messages == [{"role": "user", "content": "hi\nyo\nu"}] and options == {"max_tokens": 1024}
        assert store.conversations()[0].title == "hi"


@pilot_test
async def test_palette_offers_new_rename_delete_and_system_prompt(tmp_path):
    app, store, engines = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        titles = {c.title for c in app.get_system_commands(app.chat_screen)}
        assert {"New chat", "Rename chat", "Delete chat", "System prompt"} <= titles

        assert "Rename chat" in await run_command(pilot, "rename chat")
        await wait_until(pilot, lambda: isinstance(app.screen, RenameScreen), what="the rename dialog")
        app.screen.query_one("#rename-input").value = ""
        await pilot.press(*"Sea stories", "enter")
        await wait_until(pilot, lambda: store.conversations()[0].title == "Sea stories")
        assert "Sea stories" in shown(app.chat_screen.query_one(ConversationList))


@pilot_test
async def test_each_chat_has_its_own_system_prompt(tmp_path):
    app, store, engines = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        first = app.chat_screen.conversation_id
        await pilot.press("f4")
        await wait_until(pilot, lambda: isinstance(app.screen, SystemPromptScreen))
        await pilot.press(*"Answer like a sailor.", "ctrl+s")
        await wait_until(pilot, lambda: store.get(first).system_prompt == "Answer like a sailor.")
        await type_and_send(pilot, "hi")
        await idle(pilot)
        assert engines[0].requests[-1][0][0] == {"role": "system", "content": "Answer like a sailor."}

        await pilot.press("ctrl+n")
        await wait_until(pilot, lambda: app.chat_screen.conversation_id != first)
        await type_and_send(pilot, "hello")
        await idle(pilot)
        assert engines[0].requests[-1][0] == [{"role": "user", "content": "hello"}]


@pilot_test
async def test_delete_asks_first_and_chats_survive_a_restart(tmp_path):
    app, store, engines = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await two_chats(pilot, "keep me", "delete me")
        assert [c.title for c in store.conversations()] == ["delete me", "keep me"]
        await pilot.press("f8")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("n")
        await pilot.press("f8")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("y")
        await wait_until(pilot, lambda: [c.title for c in store.conversations()] == ["keep me"])
    store.close()

    app, store, engines = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await idle(pilot)
        views = app.chat_screen.query(MessageView)
        assert [v.role for v in views] == ["user", "assistant"] and views[0].text == "keep me"
        # Reopening a chat loads its prefix into the pool at once (one token
        # asked for), fitted to the context as its replies will be.
        assert engines[0].requests[0][1] == {"max_tokens": 1, "reply_room": app.generation["max_tokens"]}


@pilot_test
async def test_a_chat_deleted_by_another_window_is_noticed_not_a_crash(tmp_path):
    app, store, engines = make_app(tmp_path)
    other = ChatStore(tmp_path / "chats.sqlite3")  # a second `mlxkv chat` on the same database
    async with app.run_test(size=SIZE) as pilot:
        await two_chats(pilot, "first chat", "second chat")
        second = app.chat_screen.conversation_id
        other.delete(second)
        await type_and_send(pilot, "unsent")
        await wait_until(pilot, lambda: app.chat_screen.conversation_id != second, what="another chat to open")
        assert any("deleted in another window" in n.message for n in app._notifications)
        assert app.chat_screen.query_one(PromptInput).text == "unsent"  # kept, to send again
        assert [v.text for v in app.chat_screen.query(MessageView)][0] == "first chat"
        for key in ("f2", "f4", "f8"):  # each action on a chat deleted meanwhile
            other.delete(app.chat_screen.conversation_id)
            gone = app.chat_screen.conversation_id
            app._notifications.clear()
            await pilot.press(key)
            await wait_until(pilot, lambda: app.chat_screen.conversation_id != gone, what=f"{key}: another chat")
            assert app.screen is app.chat_screen
            assert any("deleted in another window" in n.message for n in app._notifications)
        # Picking a chat from a list drawn before another window deleted it.
        listed = other.create("listed").id
        app.chat_screen.show_list()
        other.delete(listed)
        await app.chat_screen.open_conversation(listed)
        assert app.chat_screen.conversation_id != listed and store.get(app.chat_screen.conversation_id)
        await type_and_send(pilot, " and still works")  # after the text kept from before
        await idle(pilot)
        assert store.messages(app.chat_screen.conversation_id)[0].content == "unsent and still works"
    other.close()


@pilot_test
async def test_a_chat_database_that_cannot_be_written_is_a_notification(tmp_path):
    app, store, engines = make_app(tmp_path, auto=False)

    def not_saved() -> bool:
        found = any("cannot save to the chat database" in n.message for n in app._notifications)
        app._notifications.clear()
        return found

    async with app.run_test(size=SIZE) as pilot:
        await send_first(pilot, engines, "saved")
        store.db.execute("PRAGMA query_only = ON")  # every write fails, as on a full disk
        engines[0].handles[0]._put(GenerationChunk("a reply", 0, "length", fixed_stats()))
        await idle(pilot)
        assert not_saved() and app.chat_screen.query(MessageView).last().text == "a reply"  # still shown
        await type_and_send(pilot, "unsaved")
        await pilot.pause()
        assert not_saved() and app.chat_screen.query_one(PromptInput).text == "unsaved"  # nothing lost
        assert len(engines[0].handles) == 1  # and nothing sent
        await pilot.press("ctrl+n")
        await pilot.pause()
        assert not_saved() and len(store.conversations()) == 1
        await pilot.press("f2")
        await wait_until(pilot, lambda: isinstance(app.screen, RenameScreen))
        await pilot.press("x", "enter")
        await wait_until(pilot, lambda: app.screen is app.chat_screen)
        assert not_saved()
        await pilot.press("f8")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("y")
        await wait_until(pilot, lambda: app.screen is app.chat_screen)
        assert not_saved() and len(store.conversations()) == 1
        store.db.execute("PRAGMA query_only = OFF")  # space again: the kept text goes out
        app.chat_screen.query_one(PromptInput).focus()
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(engines[0].handles) == 2, what="the resent message")
        assert [m.content for m in store.messages(app.chat_screen.conversation_id)] == ["saved", "unsaved"]


@pilot_test
async def test_the_last_chat_deleted_elsewhere_while_writes_fail_is_not_a_crash(tmp_path):
    app, store, engines = make_app(tmp_path)
    other = ChatStore(tmp_path / "chats.sqlite3")
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.chat_screen.conversation_id is not None, what="the first chat")
        gone = app.chat_screen.conversation_id
        other.delete(gone)  # no chat left, and this window cannot make one
        store.db.execute("PRAGMA query_only = ON")
        await pilot.press("f2")
        await wait_until(pilot, lambda: any("cannot save to the chat database" in n.message
                                            for n in app._notifications), what="the notification")
        assert app.screen is app.chat_screen and app.chat_screen.conversation_id == gone
        store.db.execute("PRAGMA query_only = OFF")
        await pilot.press("f2")  # the next action tries again
        await wait_until(pilot, lambda: app.chat_screen.conversation_id != gone, what="a new chat")
        assert [c.id for c in store.conversations()] == [app.chat_screen.conversation_id]
    other.close()


@pilot_test
async def test_a_reply_whose_prompt_left_out_the_oldest_turns_says_so(tmp_path):
    app, store, engines = make_app(tmp_path)

    def told(n: int) -> int:
        found = sum(f"its first {n} messages are left out" in m.message for m in app._notifications)
        app._notifications.clear()
        return found

    async with app.run_test(size=SIZE) as pilot:
        engines[0].left_out = 4  # what the engine thread says when the chat is longer than the context
        await two_chats(pilot, "first chat", "second chat")
        assert told(4) == 2  # once for each chat
        await type_and_send(pilot, "more")
        await idle(pilot)
        assert told(4) == 0  # the same start: said already
        engines[0].left_out = 6
        await type_and_send(pilot, "and more")
        await idle(pilot)
        assert told(6) == 1  # the start moved
        await app.chat_screen.open_conversation(store.conversations()[1].id)
        await idle(pilot)  # reopening loads the prefix (a fitted request too): nothing to say then
        assert len(engines[0].handles) == 5 and told(6) == 0


@pilot_test
async def test_the_view_follows_the_stream_only_at_the_bottom(tmp_path):
    app, store, engines = make_app(tmp_path, auto=False)
    async with app.run_test(size=SIZE) as pilot:
        await type_and_send(pilot, "go")
        log = app.chat_screen.query_one(ChatLog)
        handle = engines[0].handles[0]
        fed = 0

        async def feed(lines):
            nonlocal fed
            height = log.max_scroll_y
            for _ in range(lines):
                handle._put(GenerationChunk(f"line {fed}\n\n", fed))
                fed += 1
            view = app.chat_screen.query(MessageView)[-1]
            await wait_until(pilot, lambda: f"line {fed - 1}" in view.text and log.max_scroll_y > height)
            await pilot.pause(0.1)

        await feed(60)
        await wait_until(pilot, lambda: log.scroll_y == log.max_scroll_y > 0, what="following")
        log.scroll_to(y=0, animate=False)
        await pilot.pause(0.1)
        await feed(20)
        assert log.scroll_y == 0 < log.max_scroll_y  # the user scrolled up: left alone
        log.scroll_end(animate=False)
        await pilot.pause(0.1)
        await feed(20)
        await wait_until(pilot, lambda: log.scroll_y == log.max_scroll_y, what="following again")
        handle._put(GenerationChunk("end", 99, "length", fixed_stats()))
        await idle(pilot)


@pilot_test
async def test_escape_stops_and_a_send_while_streaming_is_refused(tmp_path):
    app, store, engines = make_app(tmp_path, auto=False)
    async with app.run_test(size=SIZE) as pilot:
        await type_and_send(pilot, "go")
        handle = engines[0].handles[0]
        handle._put(GenerationChunk("partial ", 0))
        await wait_until(pilot, lambda: app.chat_screen.query(MessageView)[-1].text == "partial ")
        await type_and_send(pilot, "too soon")
        assert len(engines[0].requests) == 1 and app.chat_screen.query_one(PromptInput).text == "too soon"
        await pilot.press("escape")
        assert handle.cancelled
        handle._put(GenerationChunk("reply", 1, "cancelled", fixed_stats()))
        await idle(pilot)
        kept = store.messages(app.chat_screen.conversation_id)[-1]
        assert (kept.role, kept.content, kept.finish_reason) == ("assistant", "partial reply", "cancelled")


@pilot_test
async def test_a_reply_does_not_rebuild_the_footer(tmp_path):
    # Rebuilding it is UI work that would share the CPU with decoding.
    from textual.widgets._footer import FooterKey

    app, store, engines = make_app(tmp_path, auto=False)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.chat_screen.engine_ready)
        # The footer is built, then built again as the screen settles (on a
        # loaded machine, after a single pause): take it once it holds still.
        previous, keys = None, set(app.chat_screen.query(FooterKey))
        while keys != previous:
            await pilot.pause(0.2)
            previous, keys = keys, set(app.chat_screen.query(FooterKey))
        assert any(k.action == "stop" and not k.has_class("-disabled") for k in keys)
        handle = await send_first(pilot, engines, "go")
        handle._put(GenerationChunk("done", 0, "length", fixed_stats()))
        await idle(pilot)
        await pilot.pause()
        assert set(app.chat_screen.query(FooterKey)) == keys


@pilot_test
async def test_a_refused_request_is_a_notification_not_a_crash(tmp_path):
    from mlxkv.host.engine_thread import RequestFailed

    app, store, engines = make_app(tmp_path, auto=False)
    async with app.run_test(size=SIZE) as pilot:
        await type_and_send(pilot, "go")
        engines[0].handles[0]._put(RequestFailed("prompt (5000 tokens) needs 400 blocks"))
        await idle(pilot)
        assert any("400 blocks" in n.message for n in app._notifications)
        # Unsent: kept, it would be resent (and refused) with every later message.
        box = app.chat_screen.query_one(PromptInput)
        assert box.text == "go" and not app.chat_screen.query(MessageView)
        cid = app.chat_screen.conversation_id
        assert store.messages(cid) == []
        assert store.get(cid).title == NEW_CHAT_TITLE == app.chat_screen.sub_title  # not named after it
        await pilot.press("enter")  # sent again as it is, and refused again, with text typed meanwhile
        await wait_until(pilot, lambda: len(engines[0].handles) == 2, what="the second request")
        await pilot.press(*"draft")
        engines[0].handles[1]._put(RequestFailed("prompt (5000 tokens) needs 400 blocks"))
        await idle(pilot)
        assert box.text == "draft"  # the box is not overwritten: the message stays in the chat
        assert [m.content for m in store.messages(cid)] == ["go"]
        assert [v.role for v in app.chat_screen.query(MessageView)] == ["user"]
        assert store.get(cid).title == "go"


@pilot_test
async def test_an_engine_error_with_brackets_is_shown_as_text(tmp_path):
    from mlxkv.host.engine_thread import RequestFailed

    app, store, engines = make_app(tmp_path, auto=False)
    async with app.run_test(size=SIZE, notifications=True) as pilot:  # toasts drawn, as in a terminal
        await type_and_send(pilot, "go")
        # MLX's messages look like this; read as markup, "[/]" crashed the toast.
        engines[0].handles[0]._put(RequestFailed("ValueError: [convert] Only length-1 arrays [/]"))
        await idle(pilot)
        toasts = "\n".join(shown(toast) for toast in app.screen.query("Toast"))
        assert "[convert] Only length-1 arrays [/]" in toasts
        assert app.is_running


def test_every_binding_has_an_id_and_a_tooltip():
    tui = mlxkv.tui
    modules = [tui.app, tui.screens.chat, tui.screens.confirm, tui.screens.error, tui.screens.image_path,
               tui.screens.rename, tui.screens.system_prompt, tui.widgets.prompt_input]
    classes = [c for m in modules for _, c in inspect.getmembers(m, inspect.isclass) if c.__module__ == m.__name__]
    bindings = [b for c in classes for b in c.__dict__.get("BINDINGS", [])]
    assert len(bindings) >= 12
    assert all(b.id and b.tooltip for b in bindings), [b for b in bindings if not (b.id and b.tooltip)]
    assert len({b.id for b in bindings}) == len(bindings)


def test_store_schema_version_and_refusing_a_newer_file(tmp_path):
    path = tmp_path / "chats.sqlite3"
    store = ChatStore(path)
    assert store.db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 3
    cid = store.create("t", system_prompt="be brief").id
    store.add_message(cid, Message("user", "hi"))
    store.add_message(cid, Message("assistant", "yo", "length", {"prompt_tokens": 3}))
    store.add_message(cid, Message("user", "again"))
    store.add_message(cid, Message("assistant", "yo yo", "stop", None, [7, 8, 2]))
    assert store.prompt_messages(cid) == [{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": "hi"},
                                          {"role": "assistant", "content": "yo"},
                                          {"role": "user", "content": "again"},
                                          {"role": "assistant", "content": "yo yo", "tokens": [7, 8, 2]}]
    # Ids that are not a list of ids (a damaged row) are dropped: the text is sent.
    store.db.execute("UPDATE messages SET tokens = '[7, \"x\"' WHERE content = 'yo yo'")
    assert store.messages(cid)[-1].tokens is None
    store.delete(cid)
    assert store.db.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 0
    store.close()
    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version = 99")
    db.commit()
    db.close()
    with pytest.raises(MlxkvError, match="newer"):
        ChatStore(path)


@pilot_test
async def test_switches_in_quick_succession_leave_one_engine_open_the_last_ones(tmp_path):
    store = ChatStore(tmp_path / "chats.sqlite3")
    engines = {"a": [], "b": []}

    def starter(name):
        def start(on_event):
            engines[name].append(ScriptedEngine(on_event))
            return engines[name][-1]
        return start

    app = ChatApp(starter("a"), store, model_name="a", cursor_blink=False, models={"b": starter("b")})
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.chat_screen.engine_ready, what="a to load")
        await asyncio.gather(app.switch_model("b"), app.switch_model("a"), app.switch_model("b"))
        await wait_until(pilot, lambda: app.chat_screen.engine_ready, what="the last switch's model")
        opened = engines["a"] + engines["b"]
        assert app.model_name == "b" and app.engine is engines["b"][-1]
        assert [e for e in opened if not e.closed] == [app.engine]  # none leaked, none started twice
    store.close()


@pilot_test
async def test_a_switch_whose_model_fails_to_load_goes_back_to_the_model_before_and_the_app_stays(tmp_path):
    store = ChatStore(tmp_path / "chats.sqlite3")
    started = []

    def good(on_event):
        started.append(ScriptedEngine(on_event))
        return started[-1]

    def broken(on_event):
        return StuckEngine(on_event, [EngineEvent("failed", "config.json: no such file")])

    app = ChatApp(good, store, model_name="a", cursor_blink=False, models={"b": broken})
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.chat_screen.engine_ready, what="a to load")
        await app.chat_screen.switch_model("b")
        await wait_until(pilot, lambda: len(started) == 2 and app.chat_screen.engine_ready, what="a again")
        assert app.model_name == "a" and app.engine is started[-1] and app.load_error is None
        assert app.screen is app.chat_screen  # no error screen: the chat goes on
        assert store.get(app.chat_screen.conversation_id).model == "a"
    assert app.return_code in (None, 0)
    store.close()


def test_a_chat_moved_to_another_model_drops_its_replies_ids_the_old_tokenizer_made(tmp_path):
    store = ChatStore(tmp_path / "chats.sqlite3")
    cid = store.create("t").id  # saved before chats remembered their model: its ids are the one model's
    store.add_message(cid, Message("assistant", "yo", "stop", None, [7, 8, 2]))
    store.set_model(cid, "llama")
    assert store.messages(cid)[-1].tokens == [7, 8, 2]
    store.set_model(cid, "llama")  # the same model: its ids still hold
    assert store.messages(cid)[-1].tokens == [7, 8, 2]
    store.set_model(cid, "qwen")
    assert (store.get(cid).model, store.messages(cid)[-1].tokens) == ("qwen", None)  # sent back as text
    store.close()


def test_a_version_1_database_is_upgraded_in_place_and_ids_are_never_reused(tmp_path):
    path = tmp_path / "chats.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(f"BEGIN; {MIGRATIONS[0]}; PRAGMA user_version = 1; COMMIT;")
    for cid, title in ((1, "kept"), (2, "newest")):
        db.execute("INSERT INTO conversations (id, title, created_at, updated_at) VALUES (?, ?, 0, 0)", (cid, title))
        db.execute("INSERT INTO messages (conversation_id, role, content, created_at) VALUES (?, 'user', ?, 0)",
                   (cid, f"hello {title}"))
    db.commit()
    db.close()
    store = ChatStore(path)
    assert store.db.execute("PRAGMA user_version").fetchone()[0] == 3
    assert [(c.id, c.title) for c in store.conversations()] == [(2, "newest"), (1, "kept")]
    assert [m.content for m in store.messages(1)] == ["hello kept"]
    assert store.prompt_messages(1) == [{"role": "user", "content": "hello kept"}]  # no ids: sent as text
    store.delete(2)  # the newest id: version 1 gave it to the next new chat
    assert store.messages(2) == []  # foreign keys on again: its messages went with it
    assert store.create("new").id == 3
    assert [m.content for m in store.messages(1)] == ["hello kept"]
    store.close()


@pilot_test
async def test_deleting_a_chat_mid_reply_does_not_put_the_reply_in_the_next_one(tmp_path):
    app, store, engines = make_app(tmp_path, auto=False)
    async with app.run_test(size=SIZE) as pilot:
        handle = await send_first(pilot, engines, "the only chat")
        handle._put(GenerationChunk(text="a partial reply", token=1))
        await wait_until(pilot, lambda: "partial" in app.chat_screen.query(MessageView).last().text)
        await pilot.press("f8")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("y")
        await wait_until(pilot, lambda: store.conversations() and store.conversations()[0].title == "New chat")
        handle._put(GenerationChunk(text="", token=2, finish_reason="cancelled"))  # the cancel lands
        await idle(pilot)
        [new_chat] = store.conversations()
        assert store.messages(new_chat.id) == []


def test_unprintable_model_output_is_shown_safely():
    assert printable("a\rb\x1bc\u2028d\ne\tf") == "a\ufffdb\ufffdc\ufffdd\ne\tf"


def test_long_replies_stream_in_segments_never_inside_a_code_fence():
    from mlxkv.tui.segments import HARD_SEGMENT_CHARS, SEGMENT_CHARS, Segmenter

    segmenter = Segmenter()
    prose = ("word " * 30 + "\n") * (SEGMENT_CHARS // 150 + 2)
    fence = "```\n" + ("x = 1\n" * (SEGMENT_CHARS // 3)) + "```\n"
    line = "long " * (HARD_SEGMENT_CHARS // 4)  # a line with no break: cut at a space
    text = prose + fence + "after\n" + line
    deltas = [text[i:i + 7] for i in range(0, len(text), 7)]
    segments = [""]
    for delta in deltas:
        pieces = segmenter.feed(delta)
        segments[-1] += pieces[0]
        segments += pieces[1:]
    assert "".join(segments) == text
    assert len(segments) >= 3
    assert not any(s.count("```") % 2 for s in segments), "a segment cut a code fence in two"
    assert any(s.startswith("long") for s in segments) and max(map(len, segments)) < 2 * HARD_SEGMENT_CHARS


@pilot_test
async def test_a_long_reply_streams_in_segments_and_ends_as_one_document(tmp_path):
    from textual.widgets import Markdown

    app, store, engines = make_app(tmp_path, auto=False)
    async with app.run_test(size=SIZE) as pilot:
        await type_and_send(pilot, "go")
        handle = engines[0].handles[0]
        paragraph = "Some words to read. " * 20 + "\n\n"
        for i in range(12):
            handle._put(GenerationChunk(paragraph, i))
        view = app.chat_screen.query(MessageView)[-1]
        await wait_until(pilot, lambda: len(view.text) == 12 * len(paragraph))
        await pilot.pause(0.1)
        assert len(view.query_children(Markdown)) > 1
        handle._put(GenerationChunk("The end.", 12, "length", fixed_stats()))
        await idle(pilot)
        (document,) = view.query_children(Markdown)
        assert document.source == printable(view.text) and view.text.endswith("The end.")


def test_the_pacer_slows_updates_when_rendering_costs_more_than_the_budget(monkeypatch):
    import mlxkv.tui.replies as replies

    clock = [0.0]
    monkeypatch.setattr(replies.time, "thread_time", lambda: clock[0])
    pacer = replies.Pacer()
    assert pacer.interval == replies.FIRST_INTERVAL_S  # nothing measured yet
    pacer.tick()
    intervals = []
    for _ in range(8):  # cheap updates: up to the full rate, by halves
        clock[0] += 0.001
        pacer.tick()
        intervals.append(pacer.interval)
    assert intervals == sorted(intervals, reverse=True) and intervals[0] < replies.FIRST_INTERVAL_S
    assert intervals[-1] == 1 / replies.UPDATE_HZ
    clock[0] += 0.020  # one update with 20 ms of UI work: slower at once, within the budget
    pacer.tick()
    assert pacer.interval == pytest.approx(0.020 / replies.UI_BUDGET)
    clock[0] += 5.0  # however slow, an update at least every SLOWEST_INTERVAL_S
    pacer.tick()
    assert pacer.interval == replies.SLOWEST_INTERVAL_S


def test_a_reply_starts_at_the_interval_the_last_one_learned(monkeypatch):
    import mlxkv.tui.replies as replies

    clock = [0.0]
    monkeypatch.setattr(replies.time, "thread_time", lambda: clock[0])
    pacer = replies.Pacer()
    for _ in range(10):
        clock[0] += 0.010
        pacer.tick()
    learned = pacer.interval
    assert learned == pytest.approx(0.010 / replies.UI_BUDGET, rel=0.01)
    clock[0] += 3.0  # drawing the finished reply, the next message: no update's cost
    pacer.start()
    pacer.tick()
    assert pacer.interval == learned
    clock[0] += 0.010
    pacer.tick()
    assert pacer.interval == pytest.approx(learned, rel=0.01)


@pilot_test
async def test_replies_of_a_screen_share_its_pacer(tmp_path):
    app, store, engines = make_app(tmp_path, auto=False)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.chat_screen
        for n, text in enumerate(("one", "two")):
            await type_and_send(pilot, text)
            await wait_until(pilot, lambda: len(engines[0].handles) == n + 1)
            assert screen.reply.pacer is screen.controller.pacer
            engines[0].handles[n]._put(GenerationChunk("ok", 0, "length", fixed_stats()))
            await idle(pilot)


@pilot_test
async def test_any_terminal_size_keeps_the_app_running_and_the_chat_usable(tmp_path):
    app, store, engines = make_app(tmp_path)
    async with app.run_test(size=(50, 14)) as pilot:
        await type_and_send(pilot, "hi")
        await idle(pilot)
        for size in [(30, 8), (8, 4), (1, 1), (79, 20), (100, 30), (160, 48)]:
            await pilot.resize_terminal(*size)
            await pilot.pause()
        await type_and_send(pilot, "still here")
        await idle(pilot)
        assert [v.text for v in app.chat_screen.query(MessageView) if v.role == "user"] == ["hi", "still here"]


@pilot_test
async def test_on_a_narrow_terminal_the_palette_opens_any_chat(tmp_path):
    app, store, engines = make_app(tmp_path)
    async with app.run_test(size=(70, 24)) as pilot:
        assert not app.chat_screen.query_one(ConversationList).display  # too narrow for the list
        await two_chats(pilot, "first [b]chat", "second chat")
        first = next(c for c in store.conversations() if c.title.startswith("first"))
        assert "first [b]chat" in await run_command(pilot, "open chat: first")
        await wait_until(pilot, lambda: app.chat_screen.conversation_id == first.id, what="the first chat")
        assert [v.text for v in app.chat_screen.query(MessageView)][0] == "first [b]chat"


@pilot_test
async def test_a_focused_panel_hidden_by_a_narrower_terminal_hands_typing_to_the_prompt(tmp_path):
    app, store, engines = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        app.chat_screen.query_one(ConversationList).focus()
        await pilot.resize_terminal(70, 24)
        await wait_until(pilot, lambda: isinstance(app.focused, PromptInput), what="the prompt focused")
        await pilot.press(*"ahoy")
        assert app.chat_screen.query_one(PromptInput).text == "ahoy"


@pilot_test
async def test_a_long_chat_title_takes_one_line_in_the_list(tmp_path):
    app, store, engines = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await two_chats(pilot, "a rather long first message that goes on and on " * 3, "short")
        chats = app.chat_screen.query_one(ConversationList)
        lines = [strip.text for strip in chats.render_lines(Region(0, 0, *chats.outer_size))]
        rows = [line for line in lines[1:-1] if line.strip("│ ")]
        assert len(rows) == 2 and rows[1].rstrip("│ ").endswith("…"), rows  # newest first; the long one cut


def burst(app, keys: list[str]) -> None:
    """Post keys at once, as the driver does with one read of the terminal."""
    for key in keys:
        character = {"enter": "\r", "shift+enter": None, "ctrl+s": None, "space": " "}.get(key, key)
        app.post_message(events.Key("plus" if key == "+" else key, character))


@pilot_test
async def test_enter_sends_every_key_typed_before_it_even_in_a_burst(tmp_path):
    """A fast typist, a paste-like burst or a busy machine: keys arrive
    together. Enter must not overtake the characters typed before it."""
    app, store, engines = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        box = app.chat_screen.query_one(PromptInput)
        box.focus()
        await pilot.pause()
        for keys in (["a", "h", "o", "y", "enter"], ["s", "h", "i", "f", "t", "+", "shift+enter", "x", "enter", "n", "o"]):
            burst(app, keys)
            await idle(pilot)
        cid = app.chat_screen.conversation_id
        assert [m.content for m in store.messages(cid) if m.role == "user"] == ["ahoy", "shift+\nx"]
        assert box.text == "no"  # typed after Enter: kept for the next message


@pilot_test
async def test_ctrl_s_saves_every_key_of_the_system_prompt_typed_before_it(tmp_path):
    app, store, engines = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f4")
        await wait_until(pilot, lambda: isinstance(app.screen, SystemPromptScreen))
        burst(app, ["b", "e", "space", "b", "r", "i", "e", "f", "ctrl+s"])
        cid = app.chat_screen.conversation_id
        await wait_until(pilot, lambda: any(v.role == "system" for v in app.chat_screen.query(MessageView)),
                         what="the system prompt saved and shown")
        assert store.get(cid).system_prompt == "be brief"
        # The app closes now, while the chat is still being reopened with the
        # prompt: that reopening must stop quietly (it raised NoMatches).


@pilot_test
async def test_a_reply_cut_by_the_context_says_so(tmp_path):
    app, store, engines = make_app(tmp_path, auto=False)
    async with app.run_test(size=SIZE) as pilot:
        cap = app.generation["max_tokens"]
        for n, (generated, note) in enumerate([(cap - 1, "context full"), (cap, "max tokens")]):
            await type_and_send(pilot, f"question {n}")
            await wait_until(pilot, lambda: len(engines[0].handles) > n, what="the request")
            engines[0].handles[n]._put(GenerationChunk("cut", 0, "length", fixed_stats(generated=generated)))
            await idle(pilot)
            assert app.chat_screen.query(MessageView).last().border_subtitle == note
        cid = app.chat_screen.conversation_id
        assert [m.finish_reason for m in store.messages(cid) if m.role == "assistant"] == ["context", "length"]


@pilot_test
async def test_quitting_mid_reply_keeps_the_reply_so_far(tmp_path):
    app, store, engines = make_app(tmp_path, auto=False)
    async with app.run_test(size=SIZE) as pilot:
        handle = await send_first(pilot, engines, "hello")
        handle._put(GenerationChunk("partial ", 0))
        await wait_until(pilot, lambda: app.chat_screen.query(MessageView).last().text == "partial ",
                         what="the reply so far shown")
        cid = app.chat_screen.conversation_id
        await pilot.press("ctrl+q")
    kept = [(m.role, m.content, m.finish_reason) for m in store.messages(cid)]
    assert kept == [("user", "hello", None), ("assistant", "partial ", "cancelled")]  # as Esc keeps it
