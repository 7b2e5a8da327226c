"""Replies in flight, and the relay that turns engine records into UI messages.

The relay runs in a worker thread per reply. It takes the handle's records
in batches (at most `UPDATE_HZ` a second) and posts one small message per
batch; `post_message` from a thread never waits for the UI, so the engine
thread is never slowed by rendering.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from mlxkv.engine_thread import RequestHandle, is_last
from mlxkv.records import GenerationChunk
from tui.messages import ReplyDelta, ReplyEnded
from tui.widgets.message_view import MessageView

UPDATE_HZ = 20
# The panel's live token count: fewer updates than the text needs.
LIVE_STATS_INTERVAL_S = 0.25


@dataclass
class ActiveReply:
    handle: RequestHandle
    conversation_id: int
    kind: str  # "reply", or "prefill" when a reopened chat's prefix is loaded
    view: MessageView | None = None
    tokens: int = 0
    first_token_at: float | None = None
    live_shown_at: float = 0.0
    started_at: float = field(default_factory=time.monotonic)

    @property
    def id(self) -> int:
        return self.handle.id

    def count(self, tokens: int) -> float | None:
        """Add `tokens`; return the decode rate so far (tokens/s) once it is known."""
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
        self.tokens += tokens
        elapsed = now - self.first_token_at
        return (self.tokens - 1) / elapsed if elapsed > 0.2 else None

    def live_stats_due(self) -> bool:
        now = time.monotonic()
        if now - self.live_shown_at < LIVE_STATS_INTERVAL_S:
            return False
        self.live_shown_at = now
        return True


def relay(reply: ActiveReply, post) -> None:
    """Forward a reply's records as ReplyDelta / ReplyEnded messages (in a thread)."""
    for batch in reply.handle.batches(1 / UPDATE_HZ):
        chunks = [r for r in batch if isinstance(r, GenerationChunk)]
        if chunks:
            post(ReplyDelta(reply.id, "".join(c.text for c in chunks), len(chunks)))
        if is_last(batch[-1]):
            post(ReplyEnded(reply.id, batch[-1]))
