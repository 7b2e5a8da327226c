"""Idefics2 with image splitting: an image is four crops and itself, five runs of placeholders with no
token between images to group them by; they group evenly, and the answers equal mlx-vlm's."""

import pytest
from test_vision_engine import BS, N, _mlx_vlm, _user
from vision_cases import make_image

from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.models.loader import load_model

pytestmark = pytest.mark.slow  # a model to write, and mlx-vlm's generate beside ours


def test_split_images_in_two_turns_equal_mlx_vlm_and_the_second_turn_hits_the_first(idefics2_dir):
    loaded = load_model(str(idefics2_dir))
    loaded.model.processor.image_processor.do_image_splitting = True
    with Engine(loaded, CacheConfig(block_size=BS), prefill_chunk=8) as engine:
        a, b = make_image(seed=3), make_image(seed=4)
        first = [_user(a, "Describe it.")]
        reply = engine.chat(first, max_tokens=N)
        assert reply.stats.image_tokens == 5 * 8 + 4  # five runs of 8 and the markers between them
        assert reply.tokens == _mlx_vlm(engine, first, [a])
        second = first + [{"role": "assistant", "content": reply.text}, _user(b, "And this one?")]
        again = engine.chat(second, max_tokens=N)
        assert again.tokens == _mlx_vlm(engine, second, [a, b])
        assert again.stats.cached_tokens["pool"] >= len(reply.prompt_tokens) // BS * BS
