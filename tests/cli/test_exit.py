"""`mlxkv` commands end when their work ends: no library teardown can hang the exit.

A process that has loaded OpenBLAS was seen hanging forever at exit, in
OpenBLAS's thread shutdown called from the dynamic linker's `_dl_fini`. The
command's exit (cli.run) skips that teardown (system/exit.py): the tests check with ld.so's
own trace that no library destructor runs, that nothing said is lost on
the way out, and that commands under load all come back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

MLXKV = str(Path(sys.executable).parent / "mlxkv")  # the installed command


def mlxkv(*args, env=None, timeout=120):
    return subprocess.run([MLXKV, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_the_command_exits_without_running_library_destructors(llama_dir):
    done = mlxkv("generate", "--model", llama_dir, "--raw", "--json", "--max-tokens", "3", "--prompt", "1 2 3",
                 env={"LD_DEBUG": "files"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1])["tokens"]  # what it printed is all there
    assert "calling init" in done.stderr  # ld.so's trace is on...
    assert "calling fini" not in done.stderr  # ...and no library's teardown ran: none can hang


def test_errors_keep_their_exit_status_and_line():
    done = mlxkv("generate", "--model", "/nonexistent/model", "--prompt", "hi")
    assert done.returncode == 2 and done.stderr.strip().startswith("mlxkv: error:")


def test_a_closed_pipe_is_no_error(llama_dir):
    head = subprocess.Popen(["head", "-c", "1"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    done = subprocess.run([MLXKV, "--help"], stdout=head.stdin, stderr=subprocess.PIPE, text=True, timeout=60)
    head.stdin.close()
    head.wait(10)
    assert done.returncode == 0 and "Traceback" not in done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("argv", [["doctor", "--json"], ["models", "list"]])
def test_a_reader_that_left_before_the_output_is_no_traceback(argv):
    """`mlxkv doctor --json | head -1`: head may be gone before the command prints at all."""
    proc = subprocess.Popen([MLXKV, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # the reader left at once
    err = proc.stderr.read()
    assert proc.wait(120) == 141 and "Traceback" not in err, err[-2000:]


@pytest.mark.slow
def test_a_bad_flag_is_one_line():
    done = mlxkv("generate", "--kv-bits", "3")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "mlxkv generate: error: argument --kv-bits: invalid choice: 3 (choose from 8, 4)"]


def test_the_parser_leaves_mlx_lm_unimported():
    """A bad flag or --help answers without loading mlx-lm (it imports transformers: a second of CPU)."""
    probe = ("import sys, mlxkv.cli; mlxkv.cli.build_parser(); "
             "print(sorted(m for m in ('mlx_lm', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


@pytest.mark.slow
def test_commands_under_load_all_come_back(llama_dir):
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        args = ["generate", "--model", llama_dir, "--raw", "--json", "--max-tokens", "8", "--prompt", "4 5 6 7"]
        started = time.monotonic()
        procs = [subprocess.Popen([MLXKV, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(6)]
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-2000:]
            assert json.loads(out.splitlines()[-1])["tokens"]
        assert time.monotonic() - started < 300
    finally:
        for burner in burners:
            burner.kill()
