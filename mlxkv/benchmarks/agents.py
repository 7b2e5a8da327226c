"""`mlxkv bench agents`: coding-agent sessions replayed against `mlxkv serve`
and `mlx_lm.server`, same model, same client (the official `openai` one,
streaming, greedy), one request at a time, in one run.

The sessions are shaped like Claude Code's or Codex's: a long head (a system
prompt and tool schemas, rendered by a template that renders tools), turns
that each add a tool result of 0.5-5k tokens, a new session on the same head
every few turns, one request cancelled in the middle of its prefill and sent
again, then a restart of the server and one more turn per session, each
resuming with a short message (the restore, not a new prefill). The model
is the agent test model (random weights, the demo model's real tokenizer:
agent_model.py), small enough for this to run in minutes on two CPU cores.

Rows: the cached fraction of mlxkv's prompts against the ideal (the longest
common prefix with an earlier prompt, in whole blocks; goal >= 0.99), the
wall time of all turns (goal <= 0.5x mlx_lm.server), TTFT median and p95,
TTFT after the restart (goal <= 0.05x), and a cold prefill of a 32k-token
prompt (goal: mlx-lm's speed, ratio <= 1.05). The cold prefill runs with
both servers up, taking turns on a new prompt each round: this machine's
speed drifts between minutes by more than the 5% the row asks about.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

from mlxkv.benchmarks.rows import format_rows, row  # noqa: F401  (format_rows: the suite's printer)
from mlxkv.benchmarks.serve import _free_port, _mlx_lm_server, _Process, _words
from mlxkv.chat.system_head import common_prefix

BLOCK = 16


@dataclass
class AgentWorkload:
    head_tokens: int = 20000  # system prompt plus tool schemas (the issue asks for 20-30k)
    sessions: int = 3  # each a new session on the same head
    turns: int = 3  # per session, before the restart
    tool_tokens: tuple[int, ...] = (500, 2000, 5000, 1200)  # tool results, in turn
    reply_tokens: int = 16
    cold_tokens: int = 32768
    cold_rounds: int = 3


@dataclass
class Played:
    wall_s: float = 0.0
    ttft: list[float] = field(default_factory=list)
    restart_ttft: list[float] = field(default_factory=list)
    # Per request: (its messages, its reply, prompt tokens cached as the server reported them).
    requests: list[tuple[list[dict], str, int]] = field(default_factory=list)
    retried: int = -1  # the request sent again after its cancel: its reuse is the retry row's
    retry_ttft: float = 0.0


def _head(w: AgentWorkload) -> tuple[dict, list[dict]]:
    """A system prompt and tool schemas of about w.head_tokens tokens (a word is about a token here)."""
    tools = [{"type": "function", "function": {
        "name": f"tool_{i}", "description": _words(w.head_tokens // 40, 100 + i),
        "parameters": {"type": "object", "properties": {"path": {"type": "string", "description": _words(40, i)}},
                       "required": ["path"]}}} for i in range(20)]
    system = {"role": "system", "content": "You are a coding agent. " + _words(w.head_tokens // 2, 1)}
    return system, tools


def _stream(server: _Process, messages: list[dict], tools: list[dict], max_tokens: int):
    """One streamed request: (reply text, TTFT, usage or None)."""
    start, first, text, usage = time.perf_counter(), None, [], None
    for chunk in server.client.chat.completions.create(model=server.model, messages=messages, tools=tools,
                                                       max_tokens=max_tokens, temperature=0.0, stream=True,
                                                       stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        delta = chunk.choices[0].delta.content if chunk.choices else None
        if delta:
            first = first or time.perf_counter()
            text.append(delta)
    return "".join(text), (first or time.perf_counter()) - start, usage


def _cancel_mid_prefill(server: _Process, messages: list[dict], tools: list[dict], after_s: float) -> None:
    """Start a request and hang up before its first token, as an agent's Esc or timeout does."""
    stream = server.client.chat.completions.create(model=server.model, messages=messages, tools=tools,
                                                   max_tokens=4, stream=True)
    time.sleep(after_s)
    stream.close()


def _play(start_server, w: AgentWorkload) -> Played:
    p = Played()
    system, tools = _head(w)
    chats = [[system, {"role": "user", "content": f"Task {s}: " + _words(60, s + 7)}] for s in range(w.sessions)]

    def turn(server, chat, record):
        reply, ttft, usage = _stream(server, chat, tools, w.reply_tokens)
        record.append(ttft)
        details = getattr(usage, "prompt_tokens_details", None)
        p.requests.append((list(chat), reply, getattr(details, "cached_tokens", 0) or 0))
        chat.append({"role": "assistant", "content": reply})
        return reply

    server = start_server()
    try:
        begin = time.perf_counter()
        for s, chat in enumerate(chats):  # a new session on the same head every `turns` turns
            for t in range(w.turns):
                turn(server, chat, p.ttft)
                if t < w.turns - 1 or s == 0:  # the next turn's tool result (session 0's is sent, cancelled, resent)
                    size = w.tool_tokens[(s + t) % len(w.tool_tokens)]
                    chat.append({"role": "user", "content": f"Tool result {t}: " + _words(size, 31 * s + t)})
            if s == 0:  # the agent's Esc mid-prefill, then the same request again
                _cancel_mid_prefill(server, chat, tools, after_s=0.5)
                retried = []
                p.retried = len(p.requests)
                turn(server, chat, retried)
                p.retry_ttft = retried[0]
            # After the restart each session resumes with a short message, so that row measures the
            # restore, not the prefill of a tool result no cache could hold (as bench serve does).
            chat.append({"role": "user", "content": "Go on."})
        p.wall_s = time.perf_counter() - begin
    finally:
        server.stop()
    server = start_server()
    try:
        begin = time.perf_counter()
        for chat in chats:
            turn(server, chat, p.restart_ttft)
            chat.append({"role": "user", "content": "Go on."})
        p.wall_s += time.perf_counter() - begin
    finally:
        server.stop()
    return p


def run_agents_benchmark(workload: AgentWorkload | None = None) -> list[dict]:
    from mlxkv.benchmarks.agent_model import agent_model_path

    w = workload or AgentWorkload()
    path = str(agent_model_path())
    ssd = tempfile.mkdtemp(prefix="mlxkv-bench-agents-")
    try:
        ours = _play(lambda: _mlxkv_server(path, ssd), w)
        theirs = _play(lambda: _mlx_lm_server(path), w)
        cold = _cold_prefills(_mlxkv_server(path, ssd), _mlx_lm_server(path), w)
    finally:
        shutil.rmtree(ssd, ignore_errors=True)
    return _rows(w, ours, theirs, cold, os.path.basename(path), _head(w)[1], path)


def _cold_prefills(ours: _Process, theirs: _Process, w: AgentWorkload) -> tuple[list[float], list[float]]:
    """TTFTs of prompts of `cold_tokens` neither server has seen: both up, taking turns (who goes
    first alternates), the same new prompt for both each round, after a short warm-up request each."""
    times: tuple[list[float], list[float]] = ([], [])
    try:
        for server in (ours, theirs):
            _stream(server, [{"role": "user", "content": _words(200, 5)}], [], 1)
        for r in range(w.cold_rounds):
            cold = [{"role": "user", "content": _words(w.cold_tokens - 64, 99 + 17 * r)}]
            order = (0, 1) if r % 2 == 0 else (1, 0)
            for side in order:
                times[side].append(_stream((ours, theirs)[side], cold, [], 1)[1])
    finally:
        ours.stop()
        theirs.stop()
    return times


def _p95(values: list[float]) -> float:
    return sorted(values)[max(0, round(0.95 * len(values)) - 1)]


def _rows(w: AgentWorkload, ours: Played, theirs: Played, cold: tuple[list[float], list[float]], model: str,
          tools: list[dict], path: str) -> list[dict]:
    ideal, cached, prompt_tokens = _reuse(ours, tools, path)
    shape = (f"{w.sessions} sessions x {w.turns} turns on a ~{w.head_tokens // 1000}k-token head, tool results "
             f"{min(w.tool_tokens)}-{max(w.tool_tokens)} tokens, a cancel and retry, a restart")
    extra = dict(model=model, head_tokens=w.head_tokens, sessions=w.sessions, turns=w.turns,
                 prompt_tokens=prompt_tokens)
    restart = statistics.median(ours.restart_ttft), statistics.median(theirs.restart_ttft)
    cold_ratio = statistics.median(a / b for a, b in zip(*cold))
    return [
        row("cached fraction of the ideal", "frac", cached / ideal if ideal else 0.0, 1.0, "ideal prefix",
            ">= 0.99", ideal > 0 and cached >= 0.99 * ideal, f"{cached} of {ideal} reusable prompt tokens", **extra),
        row("agent wall time", "s", ours.wall_s, theirs.wall_s, "mlx_lm.server", "<= 0.5",
            ours.wall_s <= 0.5 * theirs.wall_s, shape, **extra),
        row("TTFT median", "s", statistics.median(ours.ttft), statistics.median(theirs.ttft), "mlx_lm.server",
            "report", True, **extra),
        row("TTFT p95", "s", _p95(ours.ttft), _p95(theirs.ttft), "mlx_lm.server", "report", True, **extra),
        row("TTFT of the retry after a cancel", "s", ours.retry_ttft, theirs.retry_ttft, "mlx_lm.server", "report",
            True, "hung up 0.5 s into the prefill, then sent again", **extra),
        row("TTFT after restart", "s", *restart, "mlx_lm.server", "<= 0.05", restart[0] <= 0.05 * restart[1],
            "mlxkv restores from its SSD tier", **extra),
        row(f"cold prefill, {w.cold_tokens // 1024}k tokens", "s", statistics.median(cold[0]),
            statistics.median(cold[1]), "mlx_lm.server", "<= 1.05", cold_ratio <= 1.05,
            f"TTFT of a prompt neither has seen, both servers up, {len(cold[0])} alternated rounds, median of "
            f"per-round ratios: {', '.join(f'{a / b:.3f}' for a, b in zip(*cold))}", ratio=cold_ratio, **extra),
    ]


def _reuse(p: Played, tools: list[dict], path: str) -> tuple[int, int, int]:
    """(ideal reusable tokens, tokens the server reported cached, prompt tokens)
    over every request but the retried one. A request's ideal is its longest
    common prefix with an earlier prompt followed by its reply (whose last
    token's KV is never computed), never its own last token, in whole blocks."""
    from mlxkv.models.loader import load_model

    tokenizer = load_model(path).tokenizer
    seen: list[list[int]] = []
    ideal = cached = total = 0
    for i, (messages, reply, reused) in enumerate(p.requests):
        prompt = list(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True))
        if i != p.retried:
            best = max((common_prefix(prompt, s) for s in seen), default=0)
            ideal += min(best, len(prompt) - 1) // BLOCK * BLOCK
            cached += reused
            total += len(prompt)
        seen.append((prompt + list(tokenizer.encode(reply)))[:-1])
    return ideal, cached, total


def _mlxkv_server(path: str, ssd: str) -> _Process:
    port = _free_port()
    return _Process([sys.executable, "-m", "mlxkv.cli", "serve", "--model", path, "--port", str(port), "--quiet",
                     "--disk-tier", ssd], port, path)


