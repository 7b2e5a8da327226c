"""`mlxkv chat`: the Textual app around one engine thread.

The engine thread owns all MLX state; this app only submits requests and
renders the records and events it gets back as posted messages. With several
models (`mlxkv chat --model a --model b`) one is loaded at a time: the command
palette switches to another, and each conversation remembers its model, so
opening it loads that model again (the old one closes first, its cache
written to the SSD tier).
"""

from __future__ import annotations

import asyncio
import gc
import sys
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from functools import partial
from pathlib import Path

from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.markup import escape
from textual.screen import Screen

from mlxkv.config import CacheConfig
from mlxkv.system import logs
from mlxkv.system.paths import data_dir
from mlxkv.host.engine_thread import EngineEvent, EngineThread, load_engine
from mlxkv.errors import MlxkvError
from mlxkv.tui.messages import EngineNews
from mlxkv.tui.screens.chat import NEW_CHAT_TITLE, ChatScreen
from mlxkv.tui.screens.error import ErrorScreen
from mlxkv.tui.screens.loading import LoadingScreen
from mlxkv.tui.store import ChatStore

# on_event -> a started engine (an EngineThread, or a stand-in in tests)
EngineFactory = Callable[[Callable[[EngineEvent], None]], object]

# Long enough to read a path and a reason; a toast at the usual 5 s is gone
# before the eye gets to it on a screen that just appeared.
NOTE_TIMEOUT_S = 20


class ChatApp(App[None]):
    CSS_PATH = "chat.tcss"
    TITLE = "mlxkv chat"
    BINDINGS = [
        Binding("ctrl+q", "quit", "Quit", id="app.quit", priority=True,
                tooltip="Quit; conversations are saved as you go"),
        Binding("ctrl+c", "help_quit", show=False, system=True, id="app.help_quit",
                tooltip="Say how to quit (Ctrl+Q)"),
        Binding("ctrl+p", "command_palette", "Commands", id="app.command_palette", priority=True,
                show=False, tooltip="New chat, rename, delete, system prompt and more"),
    ]

    def __init__(
        self,
        engine_factory: EngineFactory,
        store: ChatStore,
        *,
        model_name: str,
        generation: dict | None = None,
        cursor_blink: bool = True,
        models: dict[str, EngineFactory] | None = None,
    ) -> None:
        super().__init__()
        self.store = store
        # Every model the palette offers, by name (the first: `model_name`'s own factory).
        self.models = {model_name: engine_factory, **(models or {})}
        self.model_name = model_name  # the model loaded or loading: on_mount and switch_model write it
        self.generation = generation or {"max_tokens": 1024}
        self.engine = None
        self._switching = asyncio.Lock()
        # The model a switch left, while the switch's model loads: where a failed load goes back to.
        self._fallback: str | None = None
        self.load_error: str | None = None  # set once the model failed to load: every way out exits 2
        self.chat_screen = ChatScreen(store, cursor_blink=cursor_blink)

    def on_mount(self) -> None:
        # The chat opened first is the most recent: its own model loads first, not one it would replace.
        recent = self.store.conversations()[:1]
        remembered = recent[0].model if recent else ""
        if remembered in self.models:
            self.model_name = remembered
        self.chat_screen.title = f"mlxkv chat · {self.model_name}"
        self.push_screen(self.chat_screen)
        self.push_screen(LoadingScreen(self.model_name))
        self.engine = self._start(self.model_name)

    def _start(self, name: str):
        """Model `name`'s engine, started; its events are posted with its name."""
        return self.models[name](lambda event: self.post_message(EngineNews(event, name)))

    async def switch_model(self, name: str) -> bool:
        """Load model `name` in place of the current one; False (and a note) while replies stream."""
        async with self._switching:  # one switch at a time: a second waits for the first's engine to start
            if name == self.model_name:
                return True
            if self.chat_screen.replies or self.chat_screen.controller.starting:
                self.notify(f"A reply is streaming; stop it (Esc) before switching to {name}.", severity="warning")
                return False
            await self._replace_engine(name, fallback=self.model_name)
            return True

    async def _switch_back(self, name: str, reason: str) -> None:
        """A switch's model failed to load: `name`, the model before it, again, and the chat goes on."""
        self.notify(f"Could not load {self.model_name}: {reason}", title="Model", severity="error",
                    timeout=NOTE_TIMEOUT_S, markup=False)
        async with self._switching:
            await self._replace_engine(name, fallback=None)
        self.chat_screen.model_reverted(name)

    async def _replace_engine(self, name: str, fallback: str | None) -> None:
        old, self.engine = self.engine, None
        self._fallback = fallback
        self.model_name = name
        self.chat_screen.engine_stopped()
        self.chat_screen.title = f"mlxkv chat · {name}"
        if isinstance(self.screen, LoadingScreen):
            self.pop_screen()
        self.push_screen(LoadingScreen(name))
        if old is not None:  # its SSD tier writes finish first (off the UI thread: they take a while)
            await asyncio.to_thread(old.close)
        self.engine = self._start(name)

    def on_engine_news(self, message: EngineNews) -> None:
        event = message.event
        if message.model != self.model_name:  # from an engine closed for another model's (its last snapshot)
            return
        if event.kind == "progress" and isinstance(self.screen, LoadingScreen):
            self.screen.show_progress(event.text, event.fraction)
        elif event.kind == "ready":
            self._fallback = None
            # What exists now lives as long as the app (modules, the model,
            # the tokenizer): keep the collector from walking it again, so a
            # full collection during a reply pauses both threads for less.
            gc.collect()
            gc.freeze()
            if isinstance(self.screen, LoadingScreen):
                self.pop_screen()
            self.chat_screen.engine_started(event.snapshot)
            for warning in event.warnings:  # e.g. the SSD tier left off, and why
                self.notify(warning, title="Cache", severity="warning", timeout=NOTE_TIMEOUT_S, markup=False)
        elif event.kind == "failed" and self._fallback is not None:
            self.run_worker(self._switch_back(self._fallback, event.text))
        elif event.kind == "failed":
            self.load_error = event.text
            if isinstance(self.screen, LoadingScreen):
                self.pop_screen()
            self.push_screen(ErrorScreen(f"Could not load {self.model_name}", event.text))
        elif event.kind == "snapshot":
            self.chat_screen.show_snapshot(event.snapshot)

    def exit(self, result=None, return_code: int = 0, message=None) -> None:
        """After a failed load, any way out (q, Esc, Ctrl+Q, the palette's Quit) is
        exit status 2 with the reason, as `mlxkv` says every error."""
        if self.load_error is not None:
            return_code, message = 2, message or f"mlxkv: error: {self.load_error}"
        super().exit(result, return_code, message)

    def on_unmount(self) -> None:
        self.chat_screen.keep_partial_replies()
        if self.engine is not None:
            self.engine.close()  # cancels open replies and finishes SSD writes
        gc.unfreeze()  # what was frozen at "ready" can be collected again

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        if isinstance(screen, ChatScreen):
            yield SystemCommand("New chat", "Start a new conversation", screen.action_new_chat)
            yield SystemCommand("Rename chat", "Rename this conversation", screen.action_rename)
            yield SystemCommand("Delete chat", "Delete this conversation", screen.action_delete)
            yield SystemCommand("System prompt", "Set this conversation's system prompt",
                                screen.action_system_prompt)
            yield SystemCommand("Attach image", "Attach an image file to the next message (as /image PATH)",
                                screen.action_attach_image)
            # Every chat by its title: the way to them on a terminal too
            # narrow for the chats list.
            for name in self.models:
                if name != self.model_name:
                    yield SystemCommand(f"Switch model: {escape(name)}", "Load this model for this conversation",
                                        partial(screen.switch_model, name))
            for conversation in self.store.conversations():
                yield SystemCommand(f"Open chat: {escape(conversation.title)}", "Switch to this conversation",
                                    partial(screen.open_conversation, conversation.id))


def load_chat_engine(model: str, cache: CacheConfig, report):
    """`load_engine`, for chat: a model without a chat template (a base model)
    fails here, on the error screen, not on every message it is sent."""
    engine = load_engine(model, cache, report)
    if not engine.has_chat_template:
        engine.close()
        raise MlxkvError(f"{model} has no chat template: mlxkv chat needs a chat (instruct) model, "
                         "such as --model demo")
    return engine


# The engine thread lets go of the GIL inside every step's mx.eval and must
# win it back from the UI thread to go on; CPython hands it over only every
# switch interval (5 ms by default, longer than a small model's decode
# step). 0.5 ms caps that wait (docs/chat-app.md, docs/benchmarks.md).
UI_SWITCH_INTERVAL_S = 0.0005


@contextmanager
def gil_hand_off(interval_s: float):
    """The GIL switch interval set to `interval_s` while the block runs."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(interval_s)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


def run(models: list[tuple[str, str]], cache: CacheConfig, *, max_tokens: int, temperature: float) -> int:
    """Run the app on `models` ((name, source) pairs; the first loads first) until the user quits;
    the exit status."""
    store = ChatStore()

    def starter(source: str) -> EngineFactory:
        return lambda on_event: EngineThread(source, cache, on_event=on_event, load=load_chat_engine).start()

    (model, source), *others = models

    log_file = None
    try:
        # An empty database gets its first chat now, so one that cannot be
        # written is a one-line error here rather than a crash in the app.
        store.most_recent(NEW_CHAT_TITLE)
        log_file = open_chat_log()
        app = ChatApp(starter(source), store, model_name=model,
                      generation={"max_tokens": max_tokens, "temperature": temperature},
                      models={name: starter(other) for name, other in others})
        with gil_hand_off(UI_SWITCH_INTERVAL_S):
            app.run()
    finally:
        store.close()
        if log_file is not None:
            logs.detach(log_file)
    return app.return_code or 0


def chat_log_path() -> Path:
    """Where `mlxkv chat` logs: beside its conversations, readable by their owner alone."""
    return data_dir() / "logs" / "chat.log"


def open_chat_log():
    """The chat's log handler (the app owns the terminal, so the log goes to a file)."""
    try:
        return logs.log_to_file(chat_log_path())
    except OSError as e:
        raise MlxkvError(f"cannot write the chat log {chat_log_path()}: {e.strerror or e}") from None
