"""--kv-bits and --kv-group-size as a user meets them: the JSON rows, doctor, and one-line errors."""

from __future__ import annotations

import json

import pytest

from test_cli import mlxkv

pytestmark = pytest.mark.slow  # subprocesses


def test_generate_json_rows_say_the_kv_format(tmp_path):
    args = ["generate", "--model", "tiny", "--raw", "--json", "--max-tokens", "3", "--no-disk-tier",
            "--prompt", "the ships sail on the sea"]
    full, q4 = mlxkv(*args), mlxkv(*args, "--kv-bits", "4", "--kv-group-size", "32", "--concurrent")
    assert full.returncode == 0 and q4.returncode == 0, full.stderr + q4.stderr
    full_row, q4_row = json.loads(full.stdout), json.loads(q4.stdout)
    assert (full_row["kv_format"], q4_row["kv_format"]) == ("float32", "q4g32")
    assert q4_row["kv_bytes_per_token"] * 4 < full_row["kv_bytes_per_token"]


@pytest.mark.parametrize(("args", "message"), [
    (["generate", "--model", "tiny", "--prompt", "hi", "--kv-bits", "8"],
     "mlxkv: error: a head dim of 32 does not split into quantization groups of 64; use --kv-group-size 32"),
    (["generate", "--model", "tiny", "--prompt", "hi", "--kv-bits", "8", "--memory-tier-bits", "8"],
     "mlxkv: error: --memory-tier-bits quantizes a full-precision pool's blocks; a pool of --kv-bits holds them "
     "quantized already, and the memory tier keeps them as they are"),
    (["generate", "--model", "tiny", "--prompt", "hi", "--kv-group-size", "32"],
     "mlxkv: error: --kv-group-size 32 sets a quantized pool's groups: add --kv-bits 8 or 4"),
    (["doctor", "--kv-group-size", "32"], "--kv-group-size 32 sets a quantized pool's groups: add --kv-bits 8 or 4"),
    (["generate", "--kv-bits", "3"], "error: argument --kv-bits: invalid choice: 3 (choose from 8, 4)"),
    (["serve", "--kv-group-size", "16"], "error: argument --kv-group-size: invalid choice: 16 (choose from 64, 32)"),
    (["chat", "--kv-bits", "2"], "error: argument --kv-bits: invalid choice: 2 (choose from 8, 4)"),
])
def test_bad_kv_formats_are_one_line_and_exit_2(args, message):
    out = mlxkv(*args)
    assert out.returncode == 2
    [line] = [line for line in out.stderr.splitlines() if "error:" in line]
    assert line.endswith(message), out.stderr


def test_doctor_says_the_kv_format_and_its_bytes():
    out = mlxkv("doctor", "--json", "--kv-bits", "4")
    assert out.returncode == 0, out.stderr
    kv = json.loads(out.stdout)["kv"]
    assert kv["format"] == "q4g64" and kv["ratio"] == 9 / 32 and kv["float16_bytes_per_token"] == 131072
    text = mlxkv("doctor", "--kv-bits", "8", "--kv-group-size", "32").stdout
    assert "kv format    q8g32: 72 KiB per token on Llama-3-8B's shape, 0.562x float16's 128 KiB" in text
