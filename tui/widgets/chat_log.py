"""The scrolling list of messages. It follows new text only while the user is at the bottom."""

from __future__ import annotations

from textual.containers import VerticalScroll

from mlxkv.tui.widgets.message_view import MessageView


class ChatLog(VerticalScroll, can_focus=True):
    def on_mount(self) -> None:
        # Anchored: new content keeps the view at the end. Scrolling up
        # releases the anchor; scrolling back to the end takes it again.
        self.anchor()

    async def show_messages(self, views: list[MessageView]) -> None:
        await self.remove_children()
        await self.mount_all(views)
        self.anchor()

    async def add(self, view: MessageView) -> MessageView:
        await self.mount(view)
        return view
