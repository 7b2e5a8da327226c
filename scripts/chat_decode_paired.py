"""Decode speed in `mlxkv chat` against the same engine thread with no UI, in one process.

Not a test: run it by hand in a real terminal (it opens the app), e.g.

    tmux new-session -x 160 -y 48 "python scripts/chat_decode_paired.py --model demo --pairs 10"

On a noisy 2-core VM the same `mlxkv generate` run varies 2x between
processes and between runs of one process, so chat_decode_speed.py needs
many runs to see a 10% effect. Here one app alternates two kinds of turn on
its own engine thread, a second or two apart: a message sent through the UI
(a new chat each time, so every turn has the same prompt) and the same
request consumed by a plain thread while the UI sits idle. Prints the
ratio of each pair, and the UI thread's CPU (share of one core) between a
UI turn's first token and its last, the cost the UI puts on decode.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

import mlxkv  # noqa: F401  (BLAS before mlx)
from mlxkv.cli import main as mlxkv_main
from mlxkv.tui import app as chat_app
from mlxkv.tui.screens.chat import ChatScreen
from chat_decode_speed import PROMPT  # the same message as the cross-process measure
from mlxkv.tui.widgets.prompt_input import PromptInput


class DecodeWindow:
    """UI-thread CPU from a reply's first update to its end, per UI turn."""

    def __init__(self) -> None:
        self.shares: list[float] = []
        self._start: tuple[float, float] | None = None
        self.ended = threading.Event()

    def patch(self) -> None:
        on_delta, on_ended = ChatScreen.on_reply_delta, ChatScreen.on_reply_ended
        window = self

        async def delta(screen, message):
            if window._start is None:
                window._start = (time.thread_time(), time.monotonic())
            await on_delta(screen, message)

        async def ended(screen, message):
            if window._start is not None:
                cpu, wall = window._start
                window.shares.append((time.thread_time() - cpu) / max(time.monotonic() - wall, 1e-9))
                window._start = None
            await on_ended(screen, message)
            window.ended.set()

        ChatScreen.on_reply_delta, ChatScreen.on_reply_ended = delta, ended


def plain_turn(app, max_tokens: int) -> float:
    handle = app.engine.submit(messages=[{"role": "user", "content": PROMPT}], max_tokens=max_tokens)
    for batch in handle.batches(0.05):
        last = batch[-1]
        if getattr(last, "finish_reason", None) and last.stats is not None:
            return last.stats.decode_tokens_per_s
    raise RuntimeError("the plain turn ended without stats")


def ui_turn(app, window: DecodeWindow) -> float:
    screen = app.chat_screen
    window.ended.clear()
    app.call_from_thread(screen.action_new_chat)

    def send():
        box = screen.query_one(PromptInput)
        box.post_message(PromptInput.Submitted(box, PROMPT))

    app.call_from_thread(send)
    if not window.ended.wait(600):
        raise RuntimeError("no reply")
    return app.call_from_thread(lambda: screen.store.messages(screen.conversation_id)[-1].stats)["decode_tokens_per_s"]


def drive(app, window: DecodeWindow, args) -> None:
    try:
        while not app.chat_screen.engine_ready:
            time.sleep(0.2)
        plain_turn(app, args.max_tokens)  # warm-up
        rates = {"plain": [], "ui": []}
        for i in range(args.pairs):
            for kind in (("plain", "ui") if i % 2 == 0 else ("ui", "plain")):
                time.sleep(0.5)
                turn = plain_turn(app, args.max_tokens) if kind == "plain" else ui_turn(app, window)
                rates[kind].append(turn)
        report(rates, window.shares, args.out)
    finally:
        app.call_from_thread(app.exit)


def report(rates: dict, shares: list[float], out: str) -> None:
    pairs = sorted(u / p for u, p in zip(rates["ui"], rates["plain"]))
    lines = [
        f"plain {statistics.median(rates['plain']):.1f} tok/s, ui {statistics.median(rates['ui']):.1f} tok/s (medians)",
        f"ui/plain per pair: median {statistics.median(pairs):.3f}, all {[round(p, 3) for p in pairs]}",
        f"UI thread while decoding: median {statistics.median(shares):.3f} of a core",
    ]
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--max-tokens", type=int, default=500)
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--out", default="chat_decode_paired.txt", help="where the result goes (the app owns the screen)")
    args = parser.parse_args()
    if args.pairs < 1 or args.max_tokens < 1:
        parser.error("--pairs and --max-tokens must be at least 1")
    if os.path.exists(args.out):
        os.remove(args.out)  # never report an earlier run's result
    work = tempfile.mkdtemp(prefix="mlxkv-paired-")
    os.environ["MLXKV_DATA_DIR"] = os.path.join(work, "data")
    window = DecodeWindow()
    window.patch()
    on_mount = chat_app.ChatApp.on_mount

    def start_driver(app):
        on_mount(app)
        threading.Thread(target=drive, args=(app, window, args), daemon=True).start()

    chat_app.ChatApp.on_mount = start_driver
    sys.argv = ["mlxkv", "chat", "--model", args.model, "--max-tokens", str(args.max_tokens),
                "--disk-tier", os.path.join(work, "kv")]
    try:
        code = mlxkv_main()
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the chats and the SSD tier of this run only
    if not os.path.exists(args.out):
        sys.exit(f"chat_decode_paired: no result (mlxkv chat exited with {code}; the model did not load?)")
    print(open(args.out).read(), end="")


if __name__ == "__main__":
    main()
