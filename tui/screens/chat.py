"""The main screen: conversations, the chat, the message box and the cache panel."""

from __future__ import annotations

import time
from contextlib import contextmanager

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer, Header, OptionList

from mlxkv.chat.image_command import attach_image, check_images
from mlxkv.errors import MlxkvError
from mlxkv.host.pool_view import PoolSnapshot
from mlxkv.tui.messages import ReplyDelta, ReplyEnded
from mlxkv.tui.replies import ActiveReply
from mlxkv.tui.reply_controller import NEW_CHAT_TITLE, ReplyController, auto_title
from mlxkv.tui.screens.confirm import ConfirmScreen
from mlxkv.tui.screens.image_path import ImagePathScreen
from mlxkv.tui.screens.rename import RenameScreen
from mlxkv.tui.screens.system_prompt import SystemPromptScreen
from mlxkv.tui.store import ChatStore, Message
from mlxkv.tui.widgets.cache_panel import CachePanel
from mlxkv.tui.widgets.chat_log import ChatLog
from mlxkv.tui.widgets.conversation_list import ConversationList
from mlxkv.tui.widgets.message_view import MessageView
from mlxkv.tui.widgets.prompt_input import PromptInput

# While a reply streams, the pool view is redrawn with the reply's updates,
# at most this often (the first snapshot of a turn, with its prefix hits,
# comes with the first token and is drawn at once).
SNAPSHOT_INTERVAL_WHILE_STREAMING_S = 1.0


class _Saved:
    """Whether a `ChatScreen._saving()` block ran to its end."""

    ok = False

    def __bool__(self) -> bool:
        return self.ok


class ChatScreen(Screen[None]):
    BINDINGS = [
        Binding("escape", "stop", "Stop", id="chat.stop",
                tooltip="Stop generating; the reply so far is kept"),
        Binding("ctrl+n", "new_chat", "New chat", id="chat.new", tooltip="Start a new conversation"),
        Binding("f2", "rename", "Rename", id="chat.rename", tooltip="Rename this conversation"),
        Binding("f4", "system_prompt", "System prompt", id="chat.system_prompt",
                tooltip="Set this conversation's system prompt"),
        Binding("f8", "delete", "Delete", id="chat.delete", tooltip="Delete this conversation"),
    ]
    # The side panels take 24 and 44 columns: on a narrower terminal the
    # chats list goes first, then the cache panel, so the chat keeps room.
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (80, "-medium"), (110, "-wide")]

    def __init__(self, store: ChatStore, *, cursor_blink: bool = True) -> None:
        super().__init__()
        self.store = store
        self.cursor_blink = cursor_blink
        self.conversation_id: int | None = None
        self.engine_ready = False
        self._snapshot_shown_at = 0.0
        self._pending_snapshot: PoolSnapshot | None = None
        self.controller = ReplyController(self)

    def compose(self) -> ComposeResult:
        yield Header(icon="")
        with Horizontal(id="main"):
            yield ConversationList(id="conversations")
            with Vertical(id="chat"):
                yield ChatLog(id="chat-log")
                yield PromptInput(id="prompt", cursor_blink=self.cursor_blink)
            yield CachePanel(id="cache-panel")
        yield Footer()

    async def on_mount(self) -> None:
        # `run` already made an empty database's first chat (a write error there is one line).
        await self.open_conversation(self.store.most_recent(NEW_CHAT_TITLE).id)
        self.query_one(PromptInput).focus()

    @property
    def reply(self) -> ActiveReply | None:
        """The reply streaming into the open chat, if any (others may stream in other chats)."""
        return self.controller.current(self.conversation_id)

    @property
    def replies(self) -> dict[int, ActiveReply]:
        return self.controller.replies

    # -- engine news (from the app) --------------------------------------

    def engine_started(self, snapshot: PoolSnapshot) -> None:
        self.engine_ready = True
        self.show_snapshot(snapshot)
        self._prefill()

    def engine_stopped(self) -> None:
        """The app closes this engine for another model's: nothing is sent until it is ready."""
        self.engine_ready = False

    def show_snapshot(self, snapshot: PoolSnapshot) -> None:
        self._pending_snapshot = snapshot
        if self.reply is None:
            self._draw_snapshot(force=True)
        # else: drawn with the reply's next update, in the same frame

    def _draw_snapshot(self, force: bool = False) -> None:
        now = time.monotonic()
        if self._pending_snapshot is None:
            return
        if force or now - self._snapshot_shown_at >= SNAPSHOT_INTERVAL_WHILE_STREAMING_S:
            self.query_one(CachePanel).show_snapshot(self._pending_snapshot)
            self._snapshot_shown_at, self._pending_snapshot = now, None

    # -- conversations ---------------------------------------------------

    async def open_conversation(self, conversation_id: int) -> None:
        """Show a chat. Replies streaming in other chats go on (the engine batches them)."""
        conversation = self.store.get(conversation_id)
        if conversation is None:  # listed here, deleted by another window since
            await self._chat_gone()
            return
        self.conversation_id = conversation_id
        if conversation.model in self.app.models and conversation.model != self.app.model_name:
            await self.app.switch_model(conversation.model)  # its prefill follows once it is ready
        messages = self.store.messages(conversation_id)
        views = [MessageView("system", conversation.system_prompt)] if conversation.system_prompt else []
        views += [MessageView(m.role, m.content, m.finish_reason) for m in messages]
        streaming = self.reply
        if streaming is not None:  # left mid-reply and back again: it streams on here
            streaming.view = MessageView.resumed("assistant", streaming.view.text)
            views.append(streaming.view)
        await self.query_one(ChatLog).show_messages(views)
        if not self.is_running:
            return  # the app quit while the messages were drawn: its widgets are gone
        self.query_one(CachePanel).show_history([m.stats for m in messages if m.role == "assistant" and m.stats])
        self.show_list()
        if streaming is None:
            self._prefill()

    async def _open_any(self) -> None:
        """The most recent chat, or a new one when there is none left.

        If that new chat cannot be saved, the deleted one stays on screen and
        the next action on it tries again."""
        with self.saving() as saved:
            conversation = self.store.most_recent(NEW_CHAT_TITLE)
        if saved:
            await self.open_conversation(conversation.id)

    async def _still_here(self) -> bool:
        """Whether the open chat still exists. A second `mlxkv chat` on the same
        database may have deleted it; then say so and open another."""
        if self.store.get(self.conversation_id) is not None:
            return True
        await self._chat_gone()
        return False

    async def _chat_gone(self) -> None:
        self.notify("This chat was deleted in another window.", severity="warning")
        await self._open_any()

    def show_list(self) -> None:
        conversation = self.store.get(self.conversation_id)
        self.sub_title = conversation.title if conversation else ""
        self.query_one(ConversationList).show(self.store.conversations(), self.conversation_id)

    def on_resize(self) -> None:
        # A focused panel that a narrower terminal hides leaves nothing
        # focused, and typing would go nowhere: give it to the prompt box.
        self.call_after_refresh(self._focus_prompt_if_lost)

    def _focus_prompt_if_lost(self) -> None:
        if self.focused is None and self.is_current:
            self.query_one(PromptInput).focus()

    async def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        if int(event.option_id) != self.conversation_id:
            await self.open_conversation(int(event.option_id))

    # -- sending and streaming -------------------------------------------

    async def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        if not self.engine_ready:
            self.notify("The model is still loading.", severity="warning")
            return
        if self.reply is not None or self.controller.starting:
            self.notify("A reply is still streaming; press Esc to stop it.", severity="warning")
            return
        if not await self._still_here():
            return  # the text stays in the box, to send again here
        text = event.text.strip()
        try:
            check_images(text)  # `/image PATH`: the file must be there
        except MlxkvError as e:
            self.notify(str(e), severity="error")
            return  # the text stays in the box
        cid = self.conversation_id
        with self.saving() as saved:
            if self.store.get(cid).title == NEW_CHAT_TITLE and not self.store.messages(cid):
                self.store.rename(cid, auto_title(text))
            self.store.set_model(cid, self.app.model_name)
            question_id = self.store.add_message(cid, Message("user", text))
        if not saved:
            return  # the text stays in the box
        event.prompt_input.take(event.text)
        self.show_list()
        log = self.query_one(ChatLog)
        question = await log.add(MessageView("user", text))
        view = await log.add(MessageView("assistant"))
        log.anchor()  # sending takes the view back to the end
        # Start once the new messages are drawn: that drawing is then done
        # before the first token, not while the engine decodes.
        self.controller.starting = True
        self.call_after_refresh(self.controller.start, "reply", cid, view, question_id=question_id,
                                question_view=question, **self.app.generation)

    def _prefill(self) -> None:
        """Load a reopened chat's prefix into the pool now (from a tier if it is there)."""
        if self.engine_ready and self.store.messages(self.conversation_id):
            self.controller.start("prefill", self.conversation_id, None, max_tokens=1,
                                  reply_room=self.app.generation["max_tokens"])  # the window replies use

    async def on_reply_delta(self, message: ReplyDelta) -> None:
        await self.controller.delta(message)
        self._draw_snapshot()

    async def on_reply_ended(self, message: ReplyEnded) -> None:
        await self.controller.ended(message)
        self._draw_snapshot(force=True)

    def keep_partial_replies(self) -> None:
        self.controller.keep_partial()

    @contextmanager
    def saving(self):
        """Around chat database writes: one that fails (disk full, a read-only
        file) is a notification, the rest of the block is skipped, and the
        app goes on. `saved` says whether the block ran to its end."""
        saved = _Saved()
        try:
            yield saved
        except MlxkvError as e:
            self.notify(str(e), title="Not saved", severity="error", timeout=10, markup=False)
            return
        saved.ok = True

    # -- actions ---------------------------------------------------------

    # Stop stays enabled in the footer: dimming it while idle rebuilt the
    # footer as each reply started, UI work in the decode window.
    def action_stop(self) -> None:
        if self.reply is not None:
            self.reply.handle.cancel()

    async def action_new_chat(self) -> None:
        with self.saving() as saved:
            conversation = self.store.create(NEW_CHAT_TITLE, model=self.app.model_name)
        if not saved:
            return
        await self.open_conversation(conversation.id)
        self.query_one(PromptInput).focus()

    async def switch_model(self, name: str) -> None:
        """The command palette's "Switch model": this conversation goes on with model `name`."""
        if not await self._still_here():
            return
        with self.saving():
            if await self.app.switch_model(name):
                self.store.set_model(self.conversation_id, name)

    def model_reverted(self, name: str) -> None:
        """The model this chat was switched to failed to load; it goes on with `name`, as before."""
        if self.conversation_id is not None and self.store.get(self.conversation_id) is not None:
            with self.saving():
                self.store.set_model(self.conversation_id, name)

    async def action_rename(self) -> None:
        if not await self._still_here():
            return
        cid = self.conversation_id

        def rename(title: str | None) -> None:
            if title:
                with self.saving():
                    self.store.rename(cid, title)
                self.show_list()

        self.app.push_screen(RenameScreen(self.store.get(cid).title), rename)

    async def action_system_prompt(self) -> None:
        if not await self._still_here():
            return
        cid = self.conversation_id

        async def save(text: str | None) -> None:
            if text is not None and self.store.get(cid) is not None:
                with self.saving() as saved:
                    self.store.set_system_prompt(cid, text)
                if not saved:
                    return
                if cid == self.conversation_id:
                    self.conversation_id = None
                    await self.open_conversation(cid)
                self.notify("System prompt saved; it applies from the next message.")

        self.app.push_screen(SystemPromptScreen(self.store.get(cid).system_prompt), save)

    def action_attach_image(self) -> None:
        """Ask for a path; a file found becomes a `/image PATH` line leading the message box."""

        def attach(path: str | None) -> None:
            if not path:
                return
            prompt = self.query_one(PromptInput)
            try:
                prompt.load_text(attach_image(prompt.text, path))
            except MlxkvError as e:
                self.notify(str(e), severity="error", markup=False)
                return
            prompt.move_cursor(prompt.document.end)
            prompt.focus()

        self.app.push_screen(ImagePathScreen(), attach)

    async def action_delete(self) -> None:
        if not await self._still_here():
            return
        cid = self.conversation_id

        async def delete(yes: bool | None) -> None:
            if not yes:
                return
            with self.saving() as saved:
                self.store.delete(cid)
            if not saved:
                return
            self.controller.cancel(cid)
            await self._open_any()

        self.app.push_screen(ConfirmScreen(f"Delete the chat {self.store.get(cid).title!r}?"), delete)
