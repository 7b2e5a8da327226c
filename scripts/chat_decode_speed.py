"""Decode speed in `mlxkv chat` (a real terminal, under tmux) against `mlxkv generate`.

Not a test (it takes minutes and needs a quiet machine): run it by hand,

    python scripts/chat_decode_speed.py --model demo --max-tokens 500 --runs 9

`--model` takes any model `mlxkv generate` takes; the README reports the
demo model (a toy: ~1.5 ms a token, so per-token thread hand-offs show)
and the bench model (decode bound by memory bandwidth, as real models are).
Each run starts both commands fresh, on the same model, prompt and cache
flags (SSD tier on, in a new directory), alternating which goes first. The
app's number is the engine's own decode_tokens_per_s for the turn, read from
the chat database; generate's comes from its --json line. Prints per-run
numbers (rate and tokens generated, so a reply cut short by EOS shows),
the medians and their ratio. With `--replies N` the app answers N chats per
run and the Nth reply is reported too: the first reply of a fresh app is
also the first time the UI draws a reply (on a 2-core VM the second reply
decoded about 10% faster than the first, median of 12 runs).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "Hello there"


def mlxkv() -> list[str]:
    script = Path(sys.executable).with_name("mlxkv")
    return [str(script)] if script.exists() else [sys.executable, "-m", "mlxkv.cli"]


def generate(model: str, max_tokens: int, work: Path) -> tuple[float, int]:
    out = subprocess.run([*mlxkv(), "generate", "--model", model, "--prompt", PROMPT, "--json",
                          "--max-tokens", str(max_tokens), "--disk-tier", str(work / "kv-generate")],
                         capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.splitlines()[-1])
    return result["decode_tokens_per_s"], len(result["tokens"])


def chat(model: str, max_tokens: int, work: Path, replies: int = 1, timeout: float = 600) -> list[tuple[float, int]]:
    """Rate and tokens of each of `replies` replies, each to the prompt in a new chat."""
    session, db = f"mlxkv-speed-{os.getpid()}", work / "data" / "chats.sqlite3"
    command = shlex.join(["env", "-u", "COLUMNS", "-u", "LINES", f"MLXKV_DATA_DIR={work / 'data'}",
                          *mlxkv(), "chat", "--model", model, "--max-tokens", str(max_tokens),
                          "--disk-tier", str(work / "kv-chat")])
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "160", "-y", "48", command], check=True)
    try:
        deadline = time.monotonic() + timeout
        while "Block pool:" not in subprocess.run(["tmux", "capture-pane", "-p", "-t", session],
                                                  capture_output=True, text=True).stdout:
            assert time.monotonic() < deadline, "the app did not load"
            time.sleep(0.2)
        for n in range(1, replies + 1):
            if n > 1:
                subprocess.run(["tmux", "send-keys", "-t", session, "C-n"], check=True)  # a new chat
                time.sleep(1.0)
            subprocess.run(["tmux", "send-keys", "-t", session, "-l", PROMPT], check=True)
            time.sleep(0.3)
            subprocess.run(["tmux", "send-keys", "-t", session, "Enter"], check=True)
            while len(rows := _reply_stats(db)) < n:
                assert time.monotonic() < deadline, "no reply"
                time.sleep(0.5)
        return [(stats["decode_tokens_per_s"], stats["generation_tokens"]) for stats in rows]
    finally:
        subprocess.run(["tmux", "send-keys", "-t", session, "C-q"])
        time.sleep(1)
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


def _reply_stats(db: Path) -> list[dict]:
    rows = sqlite3.connect(db).execute("SELECT stats FROM messages WHERE role = 'assistant' ORDER BY id").fetchall()
    return [json.loads(row[0]) for row in rows]


def _summary(label: str, generate_runs: list, chat_runs: list) -> None:
    g = statistics.median(rate for rate, _ in generate_runs)
    c = statistics.median(rate for rate, _ in chat_runs)
    print(f"{label}median: generate {g:.1f} tok/s, chat {c:.1f} tok/s, chat/generate = {c / g:.3f}")
    # The pairs' own ratios show the noise: on a 2-core VM single runs of
    # the demo model were seen from 0.5x to 1.6x.
    pairs = sorted(c / g for (g, _), (c, _) in zip(generate_runs, chat_runs))
    if len(pairs) >= 4:
        low, _, high = statistics.quantiles(pairs, n=4)
        print(f"{label}per-run chat/generate: min {pairs[0]:.3f}, quartiles {low:.3f}-{high:.3f}, max {pairs[-1]:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--max-tokens", type=int, default=500)
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--replies", type=int, default=1,
                        help="replies per app run, each in a new chat; the first and the last are reported")
    args = parser.parse_args()
    if min(args.runs, args.replies, args.max_tokens) < 1:
        parser.error("--runs, --replies and --max-tokens must be at least 1")
    generated, first, last = [], [], []
    for run in range(args.runs):
        order = ["generate", "chat"] if run % 2 == 0 else ["chat", "generate"]
        for name in order:
            with tempfile.TemporaryDirectory() as work:
                if name == "generate":
                    generated.append(generate(args.model, args.max_tokens, Path(work)))
                else:
                    replies = chat(args.model, args.max_tokens, Path(work), args.replies)
                    first.append(replies[0])
                    last.append(replies[-1])
        (g_rate, g_tokens), (c_rate, c_tokens) = generated[-1], first[-1]
        later = f", its reply {args.replies} {last[-1][0]:.1f} tok/s" if args.replies > 1 else ""
        print(f"run {run + 1}: generate {g_rate:.1f} tok/s ({g_tokens} tokens), "
              f"chat {c_rate:.1f} tok/s ({c_tokens} tokens){later}", flush=True)
    _summary("", generated, first)
    if args.replies > 1:
        _summary(f"reply {args.replies}: ", generated, last)


if __name__ == "__main__":
    main()
