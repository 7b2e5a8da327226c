"""The replies of the chat screen: started on the engine, streamed into their
views, and kept in the chat database when they end.

Replies in other chats stream on while the user reads another one (the
engine batches them); the one streaming into the open chat is `current`.
The screen routes its ReplyDelta / ReplyEnded messages here.
"""

from __future__ import annotations

from mlxkv.tui.cache_stats import as_dict
from mlxkv.tui.messages import ReplyDelta, ReplyEnded
from mlxkv.tui.replies import ActiveReply, Pacer, relay
from mlxkv.tui.store import Message
from mlxkv.tui.widgets.cache_panel import CachePanel
from mlxkv.tui.widgets.message_view import MessageView
from mlxkv.tui.widgets.prompt_input import PromptInput

NEW_CHAT_TITLE = "New chat"
AUTO_TITLE_CHARS = 48


def auto_title(first_message: str) -> str:
    """A new chat's title, from its first message."""
    return first_message.splitlines()[0][:AUTO_TITLE_CHARS]


def finish_reason_shown(finish_reason: str | None, stats: dict | None, max_tokens: int | None) -> str | None:
    """The engine's reason, or "context" for a "length" that came before
    max_tokens: the engine cuts a reply where the model's context ends."""
    if finish_reason == "length" and stats and max_tokens and stats["generation_tokens"] < max_tokens:
        return "context"
    return finish_reason


class ReplyController:
    def __init__(self, screen) -> None:
        self.screen = screen
        self.store = screen.store
        self.replies: dict[int, ActiveReply] = {}
        self.starting = False  # a reply is about to start (after the next refresh)
        self.pacer = Pacer()
        self._left_out: dict[int, int] = {}  # per chat: messages its last reply's prompt left out

    def current(self, conversation_id: int | None) -> ActiveReply | None:
        """The reply streaming into that chat, if any."""
        return next((r for r in self.replies.values()
                     if r.kind == "reply" and r.conversation_id == conversation_id), None)

    def start(self, kind: str, conversation_id: int, view: MessageView | None,
              question_id: int | None = None, question_view: MessageView | None = None, **options) -> None:
        self.starting = False
        if self.store.get(conversation_id) is None:
            return  # deleted before it could start
        handle = self.screen.app.engine.submit(messages=self.store.prompt_messages(conversation_id),
                                               fit_context=True, **options)
        self.pacer.start()
        reply = ActiveReply(handle, conversation_id, kind, self.pacer, view, question_id, question_view)
        self.replies[reply.id] = reply
        self.screen.run_worker(lambda: relay(reply, self.screen.post_message), thread=True, group="relay")

    def cancel(self, conversation_id: int) -> None:
        for reply in self.replies.values():
            if reply.conversation_id == conversation_id:
                reply.handle.cancel()

    async def delta(self, message: ReplyDelta) -> None:
        reply = self.replies.get(message.reply_id)
        if reply is None or reply.view is None:
            return
        reply.pacer.tick()
        rate = reply.count(message.ids)
        await reply.view.stream_in(message.text)
        if reply.conversation_id == self.screen.conversation_id and reply.live_stats_due():
            self.screen.query_one(CachePanel).show_live(reply.tokens, rate)

    async def ended(self, message: ReplyEnded) -> None:
        reply = self.replies.get(message.reply_id)
        if reply is None:
            return
        record = message.record
        stats = None if record.stats is None else as_dict(record.stats)
        if record.finish_reason == "error":
            taken_back = reply.tokens == 0 and await self._take_back(reply)
            note = "\nYour message is back in the box, to edit." if taken_back else ""
            self.screen.notify(record.message + note, title="The engine could not answer", severity="error",
                               timeout=8, markup=False)
        elif reply.kind == "reply":
            self._tell_left_out(reply)
        if reply.view is not None:
            max_tokens = self.screen.app.generation.get("max_tokens")
            await self._keep(reply, finish_reason_shown(record.finish_reason, stats, max_tokens), stats)
        if stats is not None and reply.conversation_id == self.screen.conversation_id:
            self.screen.query_one(CachePanel).show_turn(stats, reply.kind)
        del self.replies[reply.id]  # last: the reply counts as running until it is kept

    def _tell_left_out(self, reply: ActiveReply) -> None:
        """Say when a chat's prompt starts leaving out its oldest turns, and
        each time that start moves (not on every reply in between)."""
        left_out = reply.handle.left_out
        if left_out and left_out != self._left_out.get(reply.conversation_id):
            self.screen.notify(f"This chat is longer than the model's context: its first {left_out} "
                               "messages are left out of the prompt from now on.", title="Context full", timeout=8)
        self._left_out[reply.conversation_id] = left_out

    async def _take_back(self, reply: ActiveReply) -> bool:
        """Unsend the message the engine refused (e.g. a paste longer than the
        context): kept, it would be resent, and refused, with every later
        message of the chat. Only into an empty box of its own open chat;
        otherwise it stays where it is."""
        box = self.screen.query_one(PromptInput)
        question = reply.question_view
        if question is None or reply.conversation_id != self.screen.conversation_id or box.text:
            return False
        cid = reply.conversation_id
        with self.screen.saving() as saved:
            self.store.delete_message(reply.question_id)
            # A chat named after the message it no longer has is new again.
            if not self.store.messages(cid) and self.store.get(cid).title == auto_title(question.text):
                self.store.rename(cid, NEW_CHAT_TITLE)
        if not saved:
            return False
        self.screen.show_list()
        if question.is_attached:
            await question.remove()
        box.text = question.text
        box.move_cursor(box.document.end)
        return True

    async def _keep(self, reply: ActiveReply, finish_reason: str, stats: dict | None) -> None:
        view = reply.view
        if view.is_attached:
            await view.end_stream(finish_reason)
            if not view.text:
                await view.remove()
        if reply.id in self.replies:  # not if the app quit meanwhile: keep_partial kept it then
            self._store(reply, finish_reason, stats)

    def keep_partial(self) -> None:
        """On quit: keep each reply still streaming as far as it was shown,
        as Esc keeps it; the engine is closed next and never finishes them."""
        for reply in self.replies.values():
            if reply.view is not None:
                self._store(reply, "cancelled", None)
        self.replies.clear()

    def _store(self, reply: ActiveReply, finish_reason: str, stats: dict | None) -> None:
        """Save a reply's text, if any, unless its chat is gone. If the save
        fails, the reply stays on screen and the notification says why."""
        text = reply.view.text
        if text and self.store.get(reply.conversation_id) is not None:
            with self.screen.saving():
                message = Message("assistant", text, finish_reason, stats, reply.ids)
                self.store.add_message(reply.conversation_id, message)
