"""`mlxkv generate --concurrent`: the same JSON rows as in order; a bad prompt fails alone."""

from __future__ import annotations

import pytest

import json

from test_cli import mlxkv

pytestmark = pytest.mark.slow  # subprocesses, apps and real terminals

PROMPTS = ["the ships sail on the sea and the wind is strong",
           "the ships sail on the sea and the wind is strong and then they come home",
           "a short one"]


def _args(llama_dir, *extra):
    args = ["generate", "--model", llama_dir, "--raw", "--json", "--max-tokens", "6", "--block-size", "4"]
    for p in PROMPTS:
        args += ["--prompt", p]
    return [*args, *extra]


def test_concurrent_rows_equal_rows_in_order(llama_dir):
    in_order = mlxkv(*_args(llama_dir))
    concurrent = mlxkv(*_args(llama_dir, "--concurrent", "--prompt", " "))
    assert in_order.returncode == 0, in_order.stderr
    assert concurrent.returncode == 2 and "prompt is empty" in concurrent.stderr
    a = [json.loads(line) for line in in_order.stdout.splitlines()]
    b = [json.loads(line) for line in concurrent.stdout.splitlines()]
    assert len(a) == len(b) == 3
    assert [r.keys() for r in a] == [r.keys() for r in b]
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b]
    assert [r["prompt_tokens"] for r in a] == [r["prompt_tokens"] for r in b]
