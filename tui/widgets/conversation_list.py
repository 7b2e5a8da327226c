"""The saved conversations, most recently used first."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import OptionList
from textual.widgets.option_list import Option

from tui.store import Conversation


class ConversationList(OptionList):
    def on_mount(self) -> None:
        self.border_title = "Chats"

    def show(self, conversations: list[Conversation], current: int | None) -> None:
        self.set_options(Option(Text(c.title, no_wrap=True, overflow="ellipsis"), id=str(c.id))
                         for c in conversations)
        if current is not None and any(c.id == current for c in conversations):
            self.highlighted = self.get_option_index(str(current))
