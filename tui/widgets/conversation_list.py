"""The saved conversations, most recently used first."""

from __future__ import annotations

from textual.content import Content
from textual.widgets import OptionList
from textual.widgets.option_list import Option

from mlxkv.tui.store import Conversation


class ConversationList(OptionList):
    def on_mount(self) -> None:
        self.border_title = "Chats"

    def show(self, conversations: list[Conversation], current: int | None) -> None:
        # Content, not markup: a title is shown as typed. One line each (chat.tcss).
        self.set_options(Option(Content(c.title), id=str(c.id)) for c in conversations)
        if current is not None and any(c.id == current for c in conversations):
            self.highlighted = self.get_option_index(str(current))
