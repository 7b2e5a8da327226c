"""An inserting merge's placeholders expanded to its feature count (vision/expansion.py), on LLaVA-NeXT's
rule: a run of N placeholders becomes min(N, 2T) blocks of P, T the first image's tiles. No model: the
engine tests (test_vision_engine.py) check the counts against mlx-vlm's own embeddings."""

from types import SimpleNamespace

import numpy as np
import pytest

from mlxkv.errors import MlxkvError
from mlxkv.vision.expansion import check_image_count, expanded_tokens, expands

IMG = 9


def _config(tower="clip_vision_model", strategy="default"):
    vision = SimpleNamespace(model_type=tower, image_size=28, patch_size=14)  # 4 patches a tile
    return SimpleNamespace(model_type="llava_next", vision_config=vision, vision_feature_select_strategy=strategy)


def _inputs(tiles: int) -> dict:
    return {"pixel_values": np.zeros((1, tiles, 3, 28, 28))}


@pytest.mark.parametrize(("run", "tiles", "tower", "strategy", "features"), [
    (24, 5, "clip_vision_model", "default", 10 * 4),  # 2T = 10 blocks of the 4 patches (CLS dropped)
    (6, 5, "clip_vision_model", "default", 6 * 4),  # fewer placeholders than blocks: one block each
    (24, 5, "siglip_vision_model", "full", 10 * 4),  # Granite Vision: no CLS to drop
    (24, 5, "clip_vision_model", "full", 10 * 5),  # CLIP's CLS kept
])
def test_a_run_of_placeholders_becomes_the_features_its_merge_inserts(run, tiles, tower, strategy, features):
    tokens = [1, 2] + [IMG] * run + [3]
    out = expanded_tokens(_config(tower, strategy), tokens, IMG, _inputs(tiles))
    assert out == [1, 2] + [IMG] * features + [3]


def test_a_second_image_is_refused_naming_its_part_as_mlx_vlm_embeds_the_first_alone():
    parts = [("messages.1.content.0", {}), ("messages.3.content.1", {})]
    with pytest.raises(MlxkvError, match=r"^messages\.3\.content\.1: llava_next takes one image a request"):
        check_image_count(_config(), parts)
    check_image_count(_config(), parts[:1])
    check_image_count(SimpleNamespace(model_type="llava_onevision"), parts)


def test_only_the_inserting_families_expand():
    assert expands(_config()) and not expands(SimpleNamespace(model_type="llava_onevision"))
