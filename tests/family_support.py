"""Shared by the tests of the non-plain families: a tiny model with mlx-lm as its oracle."""

from __future__ import annotations

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
