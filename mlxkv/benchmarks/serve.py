"""`mlxkv bench serve`: an agent's session against `mlxkv serve` and
`mlx_lm.server`, same model, same client, same prompts, in one run.

The workload is what coding agents send: several sessions share a long
system prompt; each takes several turns, every turn re-sending the whole
conversation with the replies as text and a tool result added; then the
server restarts and every session resumes: the whole conversation again,
with a short user message. Each server runs alone in its own process
(started here), one request at a time, through the official `openai`
client, streaming, greedy.

Rows: wall time of all the turns, the resumed ones included (server
start-up and model loading excluded; goal: mlxkv at least 1.5x faster, so
ratio <= 0.667), the median TTFT of warm turns (a session's second turn on),
and the median TTFT of the first turn after the restart (goal <= 0.10).
mlxkv keeps its SSD tier across the restart (in a temporary directory);
mlx_lm.server keeps its prompt cache in memory only. A warm turn's TTFT is
the prefill of its tool result, which no cache avoids: both servers pay it.

Two workloads: the one above with 4 sessions x 4 turns, and 12 sessions x
3 turns, more sessions than mlx_lm.server's default prompt cache holds (10
KV caches, one per conversation); mlxkv's pool keeps blocks, shared, not
conversations.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field

from mlxkv.benchmarks.rows import format_rows, row  # noqa: F401  (format_rows: the suite's printer)
from mlxkv.errors import MlxkvError

WALL_GOAL = 1 / 1.5
RESTART_GOAL = 0.10
START_TIMEOUT_S = 300
RESUME = "We were interrupted. Continue where you left off."


@dataclass
class Workload:
    sessions: int = 4
    turns: int = 4
    system_words: int = 1200  # about 1.5k tokens on the bench model's tokenizer
    tool_words: int = 120
    reply_tokens: int = 24


@dataclass
class Measured:
    wall_s: float = 0.0
    warm_ttft: list[float] = field(default_factory=list)
    restart_ttft: list[float] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)


def _words(n: int, seed: int) -> str:
    vocab = ("file function error test build module value change return import class config path "
             "index cache block token reply prompt server client session model layer state").split()
    return " ".join(vocab[(seed * 7 + i * 13 + i * i) % len(vocab)] for i in range(n))


def _openai():
    """The official client, which these benches drive both servers with: a dev dependency, not mlxkv's own."""
    try:
        import openai
    except ImportError:
        raise MlxkvError("`mlxkv bench serve` and `bench agents` drive the servers with the official openai "
                         "client: pip install openai") from None
    return openai


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Process:
    """A server in its own process, answering on a free loopback port."""

    def __init__(self, argv: list[str], port: int, model: str):
        openai = _openai()
        self.port = port
        self.model = model  # mlx_lm.server loads any other name it is asked for
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(argv, stdout=self.log, stderr=self.log, env={**os.environ})
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="bench", max_retries=0,
                                    timeout=600)
        self._wait_up()

    def _wait_up(self) -> None:
        """Until /health answers, then one tiny request, so a server that
        loads its model lazily has loaded it before anything is timed."""
        end = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < end and self.process.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5):
                    pass
                _turn(self, [{"role": "user", "content": "hi"}], 1)
                return
            except OSError:
                time.sleep(0.1)
        self.stop()
        self.log.seek(0)
        raise RuntimeError(f"server did not start: {self.log.read().decode(errors='replace')[-2000:]}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _turn(server: _Process, messages: list[dict], max_tokens: int) -> tuple[str, float]:
    """One streamed turn: (reply text, seconds to its first text)."""
    start, first, text = time.perf_counter(), None, []
    stream = server.client.chat.completions.create(model=server.model, messages=messages, max_tokens=max_tokens,
                                            temperature=0.0, stream=True)
    for chunk in stream:
        delta = chunk.choices[0].delta.content if chunk.choices else None
        if delta:
            first = first or time.perf_counter()
            text.append(delta)
    return "".join(text), (first or time.perf_counter()) - start


def _conversations(w: Workload) -> list[list[dict]]:
    system = {"role": "system", "content": "You are a coding agent. " + _words(w.system_words, 0)}
    return [[system, {"role": "user", "content": f"Task {s}: " + _words(40, s + 1)}] for s in range(w.sessions)]


def _play(start_server, w: Workload) -> Measured:
    m = Measured()
    chats = _conversations(w)
    server = start_server()
    try:
        begin = time.perf_counter()
        for turn in range(w.turns):
            for s, chat in enumerate(chats):
                reply, ttft = _turn(server, chat, w.reply_tokens)
                m.replies.append(reply)
                if turn:
                    m.warm_ttft.append(ttft)
                chat += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": f"Tool result ({turn}): " + _words(w.tool_words, turn * 31 + s)}]
        m.wall_s = time.perf_counter() - begin
    finally:
        server.stop()
    server = start_server()
    try:
        begin = time.perf_counter()
        for chat in chats:
            chat[-1] = {"role": "user", "content": RESUME}  # the agent comes back after the restart
            reply, ttft = _turn(server, chat, w.reply_tokens)
            m.restart_ttft.append(ttft)
            m.replies.append(reply)
        m.wall_s += time.perf_counter() - begin
    finally:
        server.stop()
    return m


# The workload, then the same with more sessions than mlx_lm.server's
# default prompt cache holds (10 KV caches): many clients, one pool.
WORKLOADS = (Workload(), Workload(sessions=12, turns=3))


@dataclass
class Switch:
    """Two models behind one server under --max-loaded 1 (the bench model under two names)."""

    context_words: int = 2000  # about 4k tokens on the bench model's tokenizer (3000 words are 6k)
    reply_tokens: int = 8


RELOAD_GOAL = 0.5


def run_serve_benchmark(model: str | None = None, workloads: tuple[Workload, ...] = WORKLOADS,
                        switch: Switch | None = Switch()) -> list[dict]:
    from mlxkv.benchmarks.engine import bench_model_path

    path = str(model or bench_model_path())
    rows = [r for w in workloads for r in _rows(path, w, tagged=len(workloads) > 1)]
    return rows + ([] if switch is None else _switch_rows(path, switch))


def _switch_rows(path: str, w: Switch) -> list[dict]:
    """A conversation's turn cold (its model's load included), the switch to the other model
    (an unload and a load), then the same turn after its model came back: its prefix from the SSD tier."""
    ssd = tempfile.mkdtemp(prefix="mlxkv-bench-switch-")
    port = _free_port()
    argv = [sys.executable, "-m", "mlxkv.cli", "serve", "--model", f"a={path}", "--model", f"b={path}",
            "--max-loaded", "1", "--disk-tier", ssd, "--port", str(port)]
    chat = [{"role": "system", "content": "You are a coding agent. " + _words(w.context_words, 5)},
            {"role": "user", "content": "Where is the cache block written?"}]
    try:
        server = _Process(argv, port, "b")  # its warm-up loads b: a is cold
        try:
            server.model = "a"
            _, cold = _turn(server, chat, w.reply_tokens)
            server.model = "b"
            _, switch = _turn(server, [{"role": "user", "content": "hi"}], 1)
            server.model = "a"
            _, reload = _turn(server, chat, w.reply_tokens)
        finally:
            server.stop()
    finally:
        shutil.rmtree(ssd, ignore_errors=True)
    extra = dict(model=os.path.basename(path))
    note = f"a {w.context_words}-word conversation; the other model loaded between the turns (--max-loaded 1)"
    return [
        row("TTFT after unload and reload", "s", reload, cold, "the same turn cold, load included", "<= 0.5",
            reload <= RELOAD_GOAL * cold, note, **extra),
        row("model switch (unload, load, 1 token)", "s", switch, cold, "the cold turn", "report", True,
            "a one-token request to the other model", **extra),
    ]


def _rows(path: str, w: Workload, tagged: bool) -> list[dict]:
    ssd = tempfile.mkdtemp(prefix="mlxkv-bench-serve-")
    try:
        ours = _play(lambda: _mlxkv_server(path, ssd), w)
        theirs = _play(lambda: _mlx_lm_server(path), w)
    finally:
        shutil.rmtree(ssd, ignore_errors=True)
    # Only first turns have the same prompt on both: later ones carry the
    # replies as mlxkv's generated ids, where mlx-lm re-tokenizes their text.
    same = ours.replies[:w.sessions] == theirs.replies[:w.sessions]
    note = f"{w.sessions} sessions x {w.turns} turns, then a restart; first replies identical: {same}"
    warm = statistics.median(ours.warm_ttft), statistics.median(theirs.warm_ttft)
    restart = statistics.median(ours.restart_ttft), statistics.median(theirs.restart_ttft)
    extra = dict(model=os.path.basename(path), first_replies_identical=same, sessions=w.sessions, turns=w.turns)
    tag = f" ({w.sessions} sessions)" if tagged else ""
    return [
        row("agent wall time" + tag, "s", ours.wall_s, theirs.wall_s, "mlx_lm.server", "<= 0.667",
            ours.wall_s <= WALL_GOAL * theirs.wall_s, note, **extra),
        row("median warm TTFT" + tag, "s", warm[0], warm[1], "mlx_lm.server", "report", True, **extra),
        row("median TTFT after restart" + tag, "s", restart[0], restart[1], "mlx_lm.server", "<= 0.10",
            restart[0] <= RESTART_GOAL * restart[1], "mlxkv restores from its SSD tier", **extra),
    ]


def _mlxkv_server(path: str, ssd: str) -> _Process:
    port = _free_port()
    return _Process([sys.executable, "-m", "mlxkv.cli", "serve", "--model", path, "--port", str(port),
                     "--disk-tier", ssd], port, path)


# mlx_lm.server on the BLAS mlxkv runs on: on Linux, `import mlxkv` loads a
# real BLAS before mlx.core (system/blas.py); run bare, mlx-lm would get
# MLX's bundled reference BLAS, some 30x slower, and the ratio would be ours
# against a handicap. On a Mac the import changes nothing.
_MLX_LM_ON_OUR_BLAS = ("import runpy, sys, mlxkv; sys.argv = ['mlx_lm'] + sys.argv[1:]; "
                       "runpy.run_module('mlx_lm', run_name='__main__', alter_sys=True)")


def _mlx_lm_server(path: str) -> _Process:
    port = _free_port()
    return _Process([sys.executable, "-c", _MLX_LM_ON_OUR_BLAS, "server", "--model", path, "--port", str(port),
                     "--log-level", "WARNING"], port, path)
