"""Messages the engine side posts to the UI. Posting never waits for the UI."""

from __future__ import annotations

from textual.message import Message

from mlxkv.host.engine_thread import EngineEvent


class EngineNews(Message, bubble=False):
    """An engine-wide event: load progress, ready, failed, a pool snapshot."""

    def __init__(self, event: EngineEvent, model: str = "") -> None:
        super().__init__()
        self.event = event
        self.model = model  # the name of the model whose engine sent it


class ReplyDelta(Message, bubble=False):
    """New text of a reply: the tokens since the last update, merged."""

    def __init__(self, reply_id: int, text: str, ids: list[int]) -> None:
        super().__init__()
        self.reply_id = reply_id
        self.text = text
        self.ids = ids  # the token ids of this update


class ReplyEnded(Message, bubble=False):
    """The last record of a reply: a GenerationChunk with stats, or a RequestFailed."""

    def __init__(self, reply_id: int, record) -> None:
        super().__init__()
        self.reply_id = reply_id
        self.record = record
