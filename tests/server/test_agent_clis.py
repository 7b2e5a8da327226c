"""Real coding-agent CLIs against a real server on loopback: Claude Code
(`claude -p`, Anthropic Messages) and Codex (`codex exec`, the Responses API).

Installed by .ci/run from npm. The model has random weights, the demo
model's real tokenizer and a template that renders tools, so the agents'
prompts have their real sizes (8-13k tokens); it never calls a tool and
never stops by itself, so replies are capped short and these tests check
protocol and cache reuse, not answers. Each run gets its own HOME and
config directory, with the CLIs' background traffic off. One server for
the module; every request it gets is recorded with its prompt's tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from mlxkv.benchmarks.agent_model import agent_model_path
from mlxkv.config import CacheConfig
from mlxkv.server.server import Server, ServerOptions
from real_parts import require

pytestmark = pytest.mark.slow
BLOCK = 16
REPLY_CAP = 16
# Reuse a new session must reach, of the ideal (the longest common prefix with an earlier prompt).
GOAL = 0.95


def _cli(name: str) -> str:
    return require(name)


class Recorded:
    """The server's requests in order: (prompt tokens, reply) per request, once each ends."""

    def __init__(self, server: Server):
        self.prompts: list[list[int]] = []
        submit = server.backend.submit

        def recording(tokens, **options):
            self.prompts.append(list(tokens))
            return submit(tokens, **options)

        server.backend.submit = recording
        self.metrics = server.backend.metrics

    def mark(self) -> int:
        return len(self.prompts)


@pytest.fixture(scope="module")
def agent_server(tmp_path_factory):
    model = str(agent_model_path())
    cache = CacheConfig(block_size=BLOCK, memory_tier_bytes=0)
    with Server.load(model, cache, ServerOptions(port=0, reply_cap=REPLY_CAP)).start() as server:
        server.recorded = Recorded(server)
        yield server


def run(argv: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    base = {"PATH": os.environ["PATH"], "LANG": "C.UTF-8"}
    return subprocess.run(argv, cwd=cwd, env={**base, **env}, capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL)


def ideal(prompts: list[list[int]], prompt: list[int]) -> int:
    """The most a prefix cache can reuse: the longest common prefix with an
    earlier prompt, never the last token, in whole blocks."""
    best = 0
    for earlier in prompts:
        n = 0
        for a, b in zip(earlier, prompt):
            if a != b:
                break
            n += 1
        best = max(best, n)
    return min(best, len(prompt) - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module", autouse=True)
def cached_log(agent_server):
    """Each reply's cached tokens, in request order (from the reply stream's stats)."""
    agent_server.cached = []
    done = agent_server.backend.metrics.reply_done

    def record(stats):
        agent_server.cached.append(sum(stats.cached_tokens.values()))
        done(stats)

    agent_server.backend.metrics.reply_done = record


def check_sessions(server, first: int, continued: int, new: int) -> None:
    """`first`, `continued`, `new`: the index of each command's first request."""
    prompts, cached = server.recorded.prompts, server.cached
    assert len(cached) == len(prompts), "every request got a whole reply"
    # A continued session's second request: its history is all cached but the newest turn.
    assert cached[continued] / len(prompts[continued]) >= GOAL, (cached[continued], len(prompts[continued]))
    # A new session in the same directory, with another first prompt: all of the shared head.
    best = ideal(prompts[first:new], prompts[new])
    assert best >= 0.75 * len(prompts[new]) and cached[new] >= GOAL * best, (cached[new], best, len(prompts[new]))


def test_claude_code_sessions_reuse_the_cache(agent_server, tmp_path):
    claude = _cli("claude")
    project = tmp_path / "project"
    project.mkdir()
    env = {"HOME": str(tmp_path / "home"), "ANTHROPIC_BASE_URL": agent_server.url, "ANTHROPIC_API_KEY": "dummy",
           "ANTHROPIC_MODEL": "mlxkv-agent", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
           "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1",
           "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(REPLY_CAP), "CLAUDE_CODE_MAX_RETRIES": "0"}
    marks = []
    for args in (["Say hello."], ["--continue", "Now say goodbye."], ["List the files here."]):
        marks.append(agent_server.recorded.mark())
        done = run([claude, "-p", "--output-format", "json", *args], project, env)
        # A capped reply is "Output token limit hit" to Claude Code (exit 1), after whole replies.
        result = json.loads(done.stdout)
        assert result["session_id"] and result["num_turns"] >= 1, done.stderr
        assert result.get("api_error") in (None, "max_output_tokens"), result
    assert agent_server.recorded.mark() > marks[-1]
    check_sessions(agent_server, *marks)


def test_codex_sessions_reuse_the_cache(agent_server, tmp_path):
    codex = _cli("codex")
    home, project = tmp_path / "codex", tmp_path / "project"
    home.mkdir()
    project.mkdir()
    (home / "config.toml").write_text(f'''model = "mlxkv-agent"
model_provider = "mlxkv"
check_for_update_on_startup = false

[analytics]
enabled = false

[model_providers.mlxkv]
name = "mlxkv"
base_url = "{agent_server.url}/v1"
wire_api = "responses"
env_key = "MLXKV_TEST_KEY"
''')
    env = {"HOME": str(tmp_path / "home"), "CODEX_HOME": str(home), "MLXKV_TEST_KEY": "dummy"}
    exec_ = [codex, "exec", "--skip-git-repo-check"]
    marks = []
    for args in (["Say hello."], ["resume", "--last", "Now say goodbye."], ["List the files here."]):
        marks.append(agent_server.recorded.mark())
        done = run(exec_ + args, project, env)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip(), done.stderr[-2000:]  # the capped reply, printed
    check_sessions(agent_server, *marks)
