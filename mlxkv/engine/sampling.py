"""Samplers: mlx-lm's, with a random key of the request's own when it has a seed.

mlx-lm's samplers draw from MLX's global key. In a batch the requests'
draws interleave, so a seeded request would sample differently depending on
what else runs. A seeded request here carries its own key and splits it
exactly as MLX splits the global one, so its tokens equal a solo mlx-lm run
after `mx.random.seed(seed)`, whatever else is in the batch, and seeding one
request leaves every other request's randomness alone.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_sampler

from mlxkv.errors import MlxkvError


def make_request_sampler(
    temperature: float, top_p: float, min_p: float, top_k: int, seed: int | None
) -> Sampler:
    """logprobs `[1, vocab]` -> token `[1]`: greedy at temperature 0."""
    check_sampling(temperature, top_p, min_p, top_k, seed)
    return Sampler(temperature, top_p, min_p, top_k, seed)


MAX_SEED = 2**64 - 1  # MLX keys are 64 bits


def check_sampling(temperature: float, top_p: float, min_p: float, top_k: int, seed: int | None = None) -> None:
    """Raise MlxkvError for options a sampler would silently misread (a top_p
    of 2 turned top-p off; a NaN temperature passed every comparison) or fail
    on (a negative seed was a TypeError from mx.random.key)."""
    if not (_number(temperature) and math.isfinite(temperature) and temperature >= 0):
        raise MlxkvError(f"temperature must be a finite number >= 0, got {temperature!r}")
    for name, value in (("top_p", top_p), ("min_p", min_p)):
        if not (_number(value) and 0 <= value <= 1):
            raise MlxkvError(f"{name} must be between 0 and 1 (0 turns it off), got {value!r}")
    if not whole(top_k) or top_k < 0:
        raise MlxkvError(f"top_k must be a whole number >= 0 (0 turns it off), got {top_k!r}")
    if seed is not None and not (whole(seed) and 0 <= seed <= MAX_SEED):
        raise MlxkvError(f"seed must be a whole number from 0 to {MAX_SEED}, got {seed!r}")


def _number(value) -> bool:
    """A real number (numpy's too), not a bool or a string."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def whole(value) -> bool:
    """An integer (numpy's too), not a bool or a float."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


class Sampler:
    """A request's sampling: mlx-lm's chain (top-p, min-p, top-k, then a categorical draw
    at the temperature), on a key of its own when it has a seed.

    Calling it samples a token as mlx-lm would. A speculative step also needs
    the distribution it draws from (`scores`) and draws of its own
    (`uniform`, `categorical`), on the same key.
    """

    def __init__(self, temperature: float, top_p: float, min_p: float, top_k: int, seed: int | None):
        self.temperature, self.top_p, self.min_p, self.top_k = temperature, top_p, min_p, top_k
        self.seed = seed  # what another rank builds the same sampler from
        self.key = None if seed is None or temperature == 0 else mx.random.key(int(seed))
        self._mlx_lm = make_sampler(temp=temperature, top_p=top_p, min_p=min_p, top_k=top_k)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def __call__(self, logprobs: mx.array) -> mx.array:
        if self.key is None:
            return self._mlx_lm(logprobs)  # the global key, as mlx-lm draws
        return self.categorical(self.scores(logprobs))

    def scores(self, logprobs: mx.array) -> mx.array:
        """The logits a draw is categorical over: the filtered logprobs at the temperature."""
        if 0 < self.top_p < 1:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p != 0:
            logprobs = apply_min_p(logprobs, self.min_p)
        if self.top_k > 0:
            logprobs = apply_top_k(logprobs, self.top_k)
        return logprobs * (1 / self.temperature)

    def categorical(self, logits: mx.array) -> mx.array:
        return mx.random.categorical(logits, key=self._draw_key())

    def uniform(self, n: int) -> mx.array:
        return mx.random.uniform(shape=(n,), key=self._draw_key())

    def _draw_key(self):
        if self.key is None:
            return None
        self.key, draw = mx.random.split(self.key)  # the order MLX's global key uses
        return draw
