"""The `mlxkv` command line, run as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from faults import remount_read_only

from mlxkv.errors import MlxkvError
from mlxkv.tui.store import ChatStore

pytestmark = pytest.mark.slow  # subprocesses, apps and real terminals


def mlxkv(*args, input=None, env=None):
    return subprocess.run(
        [sys.executable, "-m", "mlxkv.cli", *args],
        capture_output=True, text=True, input=input, timeout=300, env=env,
    )


def mlxkv_in_a_terminal(*args, env=None):
    """mlxkv with a pseudo-terminal for stdin and stdout (stderr captured), as `chat` needs."""
    import pty

    leader, follower = pty.openpty()
    try:
        return subprocess.run([sys.executable, "-m", "mlxkv.cli", *args], stdin=follower, stdout=follower,
                              stderr=subprocess.PIPE, text=True, timeout=300, env=env)
    finally:
        os.close(leader)
        os.close(follower)


def test_generate_json_reuses_earlier_prompt(llama_dir):
    first = "the ships sail on the sea and the wind is strong"
    second = first + " and then they come home again"
    out = mlxkv("generate", "--model", llama_dir, "--raw", "--json", "--max-tokens", "5",
                "--block-size", "4", "--prompt", first, "--prompt", second)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert {"prompt_tokens", "tokens", "text", "cached_tokens", "computed_tokens",
                "ttft_s", "decode_tokens_per_s"} <= row.keys()
        assert len(row["tokens"]) == 5
    p1, p2 = rows[0]["prompt_tokens"], rows[1]["prompt_tokens"]
    assert p2[: len(p1)] == p1
    assert sum(rows[0]["cached_tokens"].values()) == 0
    assert rows[1]["cached_tokens"]["pool"] >= len(p1) // 4 * 4
    assert rows[1]["computed_tokens"] == len(p2) - sum(rows[1]["cached_tokens"].values())


def test_generate_streams_text_by_default(llama_dir):
    out = mlxkv("generate", "--model", llama_dir, "--max-tokens", "4", "--prompt", "hello")
    assert out.returncode == 0, out.stderr
    assert "prompt tokens" in out.stderr


def test_prompt_file_and_stdin(llama_dir, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("a prompt from a file")
    out = mlxkv("generate", "--model", llama_dir, "--json", "--max-tokens", "2",
                "--prompt-file", str(f), "--prompt-file", "-", input="one from stdin")
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.splitlines()) == 2


def test_no_prefix_cache_flag(llama_dir):
    out = mlxkv("generate", "--model", llama_dir, "--json", "--max-tokens", "2", "--block-size", "4",
                "--no-prefix-cache", "--prompt", "same words here", "--prompt", "same words here")
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["cached_tokens"]["pool"] for r in rows] == [0, 0]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt", ""], "prompt is empty"),
        (["--prompt", "hi", "--block-size", "12"], "power of two"),
        (["--prompt", "hi", "--num-blocks", "2", "--max-tokens", "64"], "pool has 2"),
        # More KV than the machine has: MLX's failed allocation was a segfault.
        (["--prompt", "hi", "--num-blocks", str(10**9)], "GiB, more than this machine's"),
        (["--prompt", "hi", "--block-size", str(2**30)], "a KV pool of 1 block of 1,073,741,824 tokens"),
        (["--prompt", "hi " * 2100, "--raw"], "context is 4096"),
        (["--prompt-file", "/no/such/file"], "cannot read prompt file"),
        ([], "no prompt given"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(llama_dir, args, message):
    out = mlxkv("generate", "--model", llama_dir, *args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr


@pytest.mark.parametrize(
    "command, flag, value, message",
    [
        ("generate", "--memory-tier-mb", "-5", "must be 0 or more, got -5"),  # not "-5242880" bytes
        ("generate", "--disk-tier-mb", "lots", "expected a whole number, got 'lots'"),
        ("generate", "--top-p", "2", "must be between 0 and 1, got 2"),  # was top-p off, silently
        ("generate", "--temp", "nan", "must be a finite number, got nan"),
        ("generate", "--temp", "inf", "must be a finite number, got inf"),  # was "must be 0 or more"
        ("generate", "--max-tokens", "0", "must be at least 1, got 0"),
        ("chat", "--temp", "-1", "must be 0 or more, got -1"),  # was refused only once the app was up
        ("bench", "--prefix", "-1", "must be 0 or more, got -1"),  # was run as a "-1-token prefix"
    ],
)
def test_numeric_flags_are_checked_before_anything_runs(command, flag, value, message):
    out = mlxkv(command, flag, value)
    assert out.returncode == 2
    [line] = [line for line in out.stderr.splitlines() if "error" in line]
    assert line.endswith(f"error: argument {flag}: {message}"), out.stderr


def test_a_seed_mlx_cannot_take_is_one_line(llama_dir):
    out = mlxkv("generate", "--model", llama_dir, "--prompt", "hi", "--temp", "0.5", "--seed", "-1")
    assert out.returncode == 2  # was a TypeError traceback from mx.random.key
    assert out.stderr.strip().splitlines() == ["mlxkv: error: seed must be a whole number from 0 to 18446744073709551615, got -1"]


def test_a_prompt_file_that_is_not_text_is_one_line(tmp_path):
    binary = tmp_path / "blob"
    binary.write_bytes(b"ok\xd1\x00\xff")
    for args, name in ((["--prompt-file", str(binary)], str(binary)), (["--prompt-file", "-"], "-")):
        out = subprocess.run([sys.executable, "-m", "mlxkv.cli", "generate", *args], input=binary.read_bytes(),
                             capture_output=True, timeout=300)
        assert out.returncode == 2
        assert out.stderr.decode().strip().splitlines() == [
            f"mlxkv: error: cannot read prompt file {name!r}: not UTF-8 text (byte 2)"]


def test_sampling_options_the_sampler_would_misread_are_refused():
    from mlxkv.engine.sampling import check_sampling

    check_sampling(0.7, 0.9, 0.05, 40)
    for bad, match in (((-1, 0, 0, 0), "temperature"), ((float("nan"), 0, 0, 0), "temperature"),
                       ((1, 1.5, 0, 0), "top_p"), ((1, 0, -0.1, 0), "min_p"), ((1, 0, 0, -1), "top_k"),
                       ((1, 0, 0, 0, -1), "seed"), ((1, 0, 0, 0, 2**64), "seed")):
        with pytest.raises(MlxkvError, match=match):
            check_sampling(*bad)


def test_unusable_disk_tier_is_one_warning_line_and_left_out(llama_dir, tmp_path):
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("")
    args = ["generate", "--model", llama_dir, "--raw", "--json", "--max-tokens", "4", "--prompt", "some words"]
    plain = mlxkv(*args, "--no-disk-tier")
    out = mlxkv(*args, "--disk-tier", str(not_a_dir))
    assert out.returncode == 0, out.stderr
    [line] = out.stderr.strip().splitlines()
    assert line == f"mlxkv: warning: SSD tier disabled: Not a directory: {not_a_dir}"
    row = json.loads(out.stdout)
    assert row["tokens"] == json.loads(plain.stdout)["tokens"]
    assert "disk" not in row["connector"]  # no tier that looks empty but is not there


def test_chat_with_an_unusable_data_dir_is_one_line_and_exit_2(tmp_path):
    a_file = tmp_path / "data"
    a_file.write_text("")
    out = mlxkv_in_a_terminal("chat", "--model", "demo", env={**os.environ, "MLXKV_DATA_DIR": str(a_file)})
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"mlxkv: error: cannot open the chat database {a_file / 'chats.sqlite3'}: Not a directory"]


def test_chat_on_a_database_that_cannot_be_written_is_one_line_and_exit_2(tmpfs):
    data = tmpfs("1m")
    ChatStore(data / "chats.sqlite3").close()  # no chat yet: the first one cannot be saved
    remount_read_only(data)
    out = mlxkv_in_a_terminal("chat", "--model", "demo", env={**os.environ, "MLXKV_DATA_DIR": str(data)})
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"mlxkv: error: cannot save to the chat database {data / 'chats.sqlite3'}: "
        "attempt to write a readonly database"]


def test_unknown_model_and_unsupported_family(tmp_path, llama_dir, monkeypatch, capsys):
    out = mlxkv("generate", "--model", str(tmp_path / "missing"), "--prompt", "hi")
    assert out.returncode == 2 and "model not found" in out.stderr
    from mlx_lm.models import llama
    from mlx_lm.models.cache import QuantizedKVCache

    from mlxkv.cli import main

    monkeypatch.setattr(llama.Model, "make_cache", lambda self: [QuantizedKVCache() for _ in self.layers],
                        raising=False)
    assert main(["generate", "--model", llama_dir, "--prompt", "hi"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("mlxkv: error: unsupported model family 'llama': mlxkv does not page quantized")


def test_demo_model_runs_offline():
    out = mlxkv("generate", "--model", "demo", "--json", "--max-tokens", "3", "--prompt", "Hello")
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["tokens"]) == 3


def test_doctor_names_blas_and_metal():
    out = mlxkv("doctor")
    assert out.returncode == 0
    assert "blas" in out.stdout and "metal" in out.stdout
    assert "attention" in out.stdout


def test_doctor_json_names_the_attention_path():
    out = mlxkv("doctor", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert {"platform", "mlx_version", "metal_available", "mlx_blas", "attention"} <= report.keys()
    if not report["metal_available"]:
        assert report["attention"] == {"path": "reference", "check": None, "gate": None,
                                       "why": "no Metal GPU: decode runs on the pure-MLX reference path"}
