"""Replies in flight, and the relay that turns engine records into UI messages.

The relay runs in a worker thread per reply. It takes the handle's records
in batches and posts one small message per batch; `post_message` from a
thread never waits for the UI, so the engine thread never waits for
rendering.

The batches come `UPDATE_HZ` times a second, unless rendering them costs
the UI thread more than `UI_BUDGET` of a core: then they come less often.
The UI shares the GIL (and, on a small machine, the cores) with the engine,
so a slow terminal or a slow machine gets fewer, bigger updates instead of
a slower model. The slowest rate is once a second.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from mlxkv.host.engine_thread import RequestHandle, is_last
from mlxkv.engine.records import GenerationChunk
from mlxkv.tui.messages import ReplyDelta, ReplyEnded
from mlxkv.tui.widgets.message_view import MessageView

UPDATE_HZ = 20
UI_BUDGET = 0.05  # of one core, for everything the UI does while a reply streams
SLOWEST_INTERVAL_S = 1.0
# Before any update's cost is known (an app's first reply).
FIRST_INTERVAL_S = 0.25
# The panel's live token count: fewer updates than the text needs.
LIVE_STATS_INTERVAL_S = 0.25


class Pacer:
    """The interval between reply updates, from what the UI thread spends on them.

    `tick()` runs on the UI thread once per update; the CPU time the thread
    used since the last tick is what one update cycle costs it. One pacer
    serves all replies of a screen, so each reply starts at the interval the
    last one learned: on a slow machine a short reply was otherwise over
    before the pacer caught up, its updates at the full rate.

    A costly update slows the rate at once; cheap ones speed it up by
    halves. An app's first reply starts at FIRST_INTERVAL_S, not the full
    rate: on a slow machine a fresh app's first reply would otherwise be
    over before the pacer caught up.
    """

    def __init__(self) -> None:
        self.interval = FIRST_INTERVAL_S
        self._cpu: float | None = None

    def start(self) -> None:
        """A reply starts: what the UI did since the last update was not an update's cost."""
        self._cpu = None

    def tick(self) -> None:
        cpu = time.thread_time()
        if self._cpu is not None:
            wanted = (cpu - self._cpu) / UI_BUDGET
            if wanted < self.interval:
                wanted = 0.5 * self.interval + 0.5 * wanted
            self.interval = min(SLOWEST_INTERVAL_S, max(1 / UPDATE_HZ, wanted))
        self._cpu = cpu


@dataclass
class ActiveReply:
    handle: RequestHandle
    conversation_id: int
    kind: str  # "reply", or "prefill" when a reopened chat's prefix is loaded
    pacer: Pacer  # the screen's own, shared by its replies
    view: MessageView | None = None
    # The user's message this reply answers (its row and view), taken back
    # if the engine refuses it: see ChatScreen._take_back.
    question_id: int | None = None
    question_view: MessageView | None = None
    ids: list[int] = field(default_factory=list)  # as generated, kept with the reply (mlxkv/reply_tokens.py)
    first_token_at: float | None = None
    live_shown_at: float = 0.0

    @property
    def id(self) -> int:
        return self.handle.id

    @property
    def tokens(self) -> int:
        return len(self.ids)

    def count(self, ids: list[int]) -> float | None:
        """Add the ids of an update; return the decode rate so far (tokens/s) once it is known."""
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
        self.ids += ids
        elapsed = now - self.first_token_at
        return (self.tokens - 1) / elapsed if elapsed > 0.2 else None

    def live_stats_due(self) -> bool:
        now = time.monotonic()
        if now - self.live_shown_at < max(LIVE_STATS_INTERVAL_S, self.pacer.interval):
            return False
        self.live_shown_at = now
        return True


def relay(reply: ActiveReply, post) -> None:
    """Forward a reply's records as ReplyDelta / ReplyEnded messages (in a thread)."""
    for batch in reply.handle.batches(lambda: reply.pacer.interval):
        chunks = [r for r in batch if isinstance(r, GenerationChunk)]
        if chunks:
            post(ReplyDelta(reply.id, "".join(c.text for c in chunks), [c.token for c in chunks]))
        if is_last(batch[-1]):
            post(ReplyEnded(reply.id, batch[-1]))
