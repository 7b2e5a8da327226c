"""Greedy output through the paged engine equals mlx-lm's, token for token."""

from __future__ import annotations

import mlx_lm
import pytest

from greedy_cases import (  # noqa: F401  (collected here)
    test_cold_prompts_match_mlx_lm,
    test_prefix_hits_match_mlx_lm,
    test_prompt_of_whole_cached_blocks,
)


@pytest.fixture(scope="module", params=["llama", "qwen3", "mistral", "qwen2", "phi3"])
def family(request, model_dirs):
    path = model_dirs[request.param]
    model, tokenizer = mlx_lm.load(path)
    return request.param, path, model, tokenizer
