"""The README's promises: its Python example runs as written, and its main
command prints what the README says it prints."""

from __future__ import annotations

import pytest

import json
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

pytestmark = pytest.mark.slow  # subprocesses, apps and real terminals

README = Path(__file__).resolve().parents[2] / "README.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), re.S)


def test_the_python_example_runs(tmp_path):
    example = next(b for b in blocks("python") if "Engine.load" in b)
    done = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()


def test_the_main_command_shows_a_prefix_hit_on_its_second_prompt():
    main = next(b for b in blocks("sh") if "mlxkv generate" in b)
    words = shlex.split(main.replace("\\\n", " "))
    argv = words[words.index("generate") + 1:]  # after the installs
    done = subprocess.run([sys.executable, "-m", "mlxkv.cli", "generate", *argv], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(rows) == 2
    assert rows[0]["cached_tokens"]["pool"] == 0 and rows[1]["cached_tokens"]["pool"] == 32
    assert "sea" in rows[0]["text"].lower()  # the demo model is a real one: its reply is about the prompt


def test_the_server_example_runs_against_mlxkv_serve(tmp_path):
    """`mlxkv serve --model demo` as written (on a free port), then the client example as written."""
    serve = next(b for b in blocks("sh") if "mlxkv serve" in b)
    client = next(b for b in blocks("python") if "OpenAI(" in b)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = shlex.split(serve.split("#")[0])[1:] + ["--port", str(port), "--disk-tier", str(tmp_path / "ssd")]
    server = subprocess.Popen([sys.executable, "-m", "mlxkv.cli", *argv], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):  # until it answers (the demo model is made on first use)
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).close()
                break
            except OSError:
                assert server.poll() is None, server.communicate()[1]
                time.sleep(0.2)
        done = subprocess.run([sys.executable, "-c", client.replace(":8000", f":{port}")], capture_output=True,
                              text=True, timeout=300, cwd=tmp_path)
    finally:
        server.send_signal(signal.SIGINT)
        server.communicate(timeout=60)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.strip()) >= 32  # the first turn's blocks, prompt and reply
