"""Shared by the tests of the non-plain families: a tiny model with mlx-lm as its oracle."""

from __future__ import annotations

import json
import subprocess
import sys

import mlx_lm
from mlx_lm.generate import stream_generate

from mlxkv.models.loader import load_model
from mlxkv.models.tiny import TinyModelSpec, write_tiny_model


def model_with_oracle(directory, spec: TinyModelSpec):
    """(path, loaded model, reference) where reference(prompt, n) is mlx-lm's greedy
    tokens for the prompt, computed once per (prompt, n)."""
    path = str(write_tiny_model(directory, spec))
    model, tokenizer = mlx_lm.load(path)
    answers = {}

    def reference(prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in answers:
            answers[key] = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens)]
        return answers[key]

    return path, load_model(path), reference


def prompt_of(n: int, salt: int = 0) -> list[int]:
    """n ordinary token ids (the tiny models' specials are 0-2), varied by `salt`."""
    return [(11 * i + 5 + salt) % 500 + 3 for i in range(n)]


def assert_next_turn_reuses_the_first(engine, reference, block: int, first_tokens: int = 75) -> None:
    """A chat's second turn is a prefix hit of the whole first turn (to its last full block), and equals mlx-lm."""
    first = prompt_of(first_tokens)
    turn1 = engine.generate(first, max_tokens=20)
    second = first + turn1.tokens + prompt_of(9, salt=3)
    turn2 = engine.generate(second, max_tokens=20)
    assert turn2.stats.cached_tokens["pool"] == (len(first) + len(turn1.tokens)) // block * block
    assert turn2.tokens == reference(second, 20)


RUN_ONCE = """
import json, sys
from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
path, disk, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
config = CacheConfig(block_size=16, num_blocks=256, disk_tier=disk, checkpoint_interval=32,
                     checkpoint_write_ratio=float(sys.argv[4]))
with Engine.load(path, config) as engine:
    r = engine.generate(prompt, max_tokens=16)
print(json.dumps({"tokens": r.tokens, "cached": r.stats.cached_tokens}))
"""


def run_in_new_process(path: str, disk, prompt: list[int], write_ratio: float = 0.0) -> dict:
    """One request (16 tokens, 16-token blocks) in a new process on the SSD tier at `disk`;
    write_ratio 0: every checkpoint a request leaves goes to SSD."""
    out = subprocess.run([sys.executable, "-c", RUN_ONCE, path, str(disk), json.dumps(prompt), str(write_ratio)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def assert_a_restart_resumes_the_chat(path: str, disk, reference, block: int = 16) -> tuple[list[int], dict]:
    """A chat's first turn in one process, its next in another: the whole first turn comes
    from disk, and both equal mlx-lm. Returns the second prompt and its result."""
    first = prompt_of(75)
    turn1 = run_in_new_process(path, disk, first)
    assert turn1["tokens"] == reference(first, 16)
    second = first + turn1["tokens"] + prompt_of(9, salt=3)
    turn2 = run_in_new_process(path, disk, second)
    assert turn2["cached"]["disk"] == (len(first) + len(turn1["tokens"])) // block * block
    assert turn2["tokens"] == reference(second, 16)
    return second, turn2
