"""Mistral 3 (Pixtral's processor) pads a request's images to the largest: an image is keyed by its own
pixels and size, not by the padding another image in the same request sets."""

import pytest
from vision_cases import make_image

from mlxkv.vision import compat
from mlxkv.vision.model import VisionModel
from mlxkv.vision.prompt import vision_prompt

pytestmark = pytest.mark.slow  # a model to write


def _user(*images):
    return [{"role": "user", "content": [*({"type": "image", "image": i} for i in images),
                                         {"type": "text", "text": "Hi"}]}]


def test_an_image_keys_the_same_beside_a_larger_image_and_its_rows_are_one_span(mistral3_dir):
    model = VisionModel(*compat.load(str(mistral3_dir)))
    small, large = make_image(56, 56, seed=1), make_image(112, 84, seed=2)
    alone = vision_prompt(model, _user(small))
    padded = vision_prompt(model, _user(large, small))
    assert padded.pixel_values.shape[-2:] == (84, 112)  # the small image padded to the large one
    assert padded.spans[1].digest == alone.spans[0].digest
    assert padded.spans[0].digest != padded.spans[1].digest
    # 112x84 in 28-pixel placeholders: 3 rows of 4, two [IMG_BREAK]s between them, in one span.
    assert padded.spans[0].length == 3 * 4 + 2


@pytest.mark.parametrize("family", ["llava_onevision", "internvl_chat"])
def test_an_image_of_few_tiles_keys_the_same_beside_one_of_more_tiles(family, request):
    """LLaVA-OneVision pads an image's AnyRes tiles with zeros to the most tiles of its request
    ([images, tiles, C, H, W]); InternVL puts all images' tiles in one row ([1, tiles, C, H, W]). (Text
    between the images: their placeholders are one token, so two images side by side are one run.)"""
    model = VisionModel(*compat.load(str(request.getfixturevalue(f"{family}_dir"))))
    small, wide = make_image(28, 28, seed=1), make_image(160, 60, seed=2)
    alone = vision_prompt(model, _user(small))
    image = {"type": "image", "image": small}
    beside = vision_prompt(model, [{"role": "user", "content": [
        {"type": "image", "image": wide}, {"type": "text", "text": "and"}, image]}])
    assert len(beside.tokens) > len(alone.tokens) + 8  # the wide image has more tiles
    assert beside.spans[1].digest == alone.spans[0].digest != beside.spans[0].digest


@pytest.mark.parametrize("family", ["kimi_vl", "kimi_k3"])
def test_the_same_patches_in_another_grid_are_another_image(family, request):
    """A one-colour 112x28 and 56x56 image are the same 16 patches of 14 px to Kimi-VL's processor, in a
    2 x 8 and a 4 x 4 grid, and the same 4 placeholders: only the grid (image_grid_hws) tells them apart,
    so it is in their keys, or the second would hit the first's KV. Kimi K3 writes an image's size into the
    text, but its encoder cache still takes an image by its key: its grid (grid_thws) is in it too."""
    from PIL import Image

    model = VisionModel(*compat.load(str(request.getfixturevalue(f"{family}_dir"))))
    red = (200, 30, 30)
    wide, square = (vision_prompt(model, _user(Image.new("RGB", size, red))) for size in ((112, 28), (56, 56)))
    assert (wide.pixel_values == square.pixel_values).all()
    assert (wide.tokens == square.tokens) == (family == "kimi_vl")
    assert wide.spans[0].digest != square.spans[0].digest



def test_minicpmo_keys_an_upscaled_image_by_all_its_pixels(minicpmo_dir):
    """MiniCPM-o's image_sizes are the original (w, h), not a crop of padded pixels: its processor scales a
    28x28 image up to 56x56, so keying the [:28, :28] corner of that gave two images differing only in
    their lower right corner one key (test_vision_engine.py's different image at the same place: the second
    image's reply was the first's)."""
    from PIL import ImageDraw

    model = VisionModel(*compat.load(str(minicpmo_dir)))
    a, b = make_image(28, 28, seed=3), make_image(28, 28, seed=3)
    ImageDraw.Draw(b).rectangle([21, 21, 27, 27], fill=(255, 0, 0))
    a, b = vision_prompt(model, _user(a)), vision_prompt(model, _user(b))
    assert a.pixel_values.shape[-2:] == (56, 56)  # upscaled past its image_sizes
    assert a.spans[0].digest != b.spans[0].digest
