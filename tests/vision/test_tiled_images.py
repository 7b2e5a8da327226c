"""Families whose image is tiles of one placeholder count each with no mask to tell them apart (InternVL's
one run, Aya Vision's runs after `TILE_i` and `TILE_GLOBAL`): a wide image of several tiles beside a
one-tile image equals mlx-vlm's generate, and each image's pixel rows are its own tiles."""

import pytest
from vision_cases import make_image

from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.models.loader import load_model
from mlxkv.vision import compat
from mlxkv.vision.prompt import vision_prompt

pytestmark = pytest.mark.slow  # a model to write, and mlx-vlm's generate beside ours
N = 8


@pytest.mark.parametrize("family", ["internvl_chat", "internvl", "aya_vision"])
def test_a_wide_image_of_three_tiles_beside_one_of_one_tile_equals_mlx_vlm(family, request):
    from mlx_vlm.generate.dispatch import stream_generate

    wide, small = make_image(160, 60, seed=2), make_image(seed=1)
    messages = [{"role": "user", "content": [{"type": "image", "image": wide}, {"type": "image", "image": small},
                                             {"type": "text", "text": "Which is wider?"}]}]
    with Engine(load_model(str(request.getfixturevalue(f"{family}_dir"))), CacheConfig(block_size=4),
                prefill_chunk=8) as engine:
        prompt = vision_prompt(engine.model, messages)
        assert prompt.tiles == [3, 1]  # two tiles and a thumbnail (a global view), then one tile
        ours = engine.generate(prompt, max_tokens=N).tokens
        model, processor = engine.model.vlm, engine.model.processor
        template = [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                                 {"type": "text", "text": "Which is wider?"}]}]
        theirs = [r.token for r in stream_generate(model, processor, compat.render_chat(processor, template),
                                                   image=[wide, small], max_tokens=N, temperature=0.0)][:N]
    assert ours == theirs
