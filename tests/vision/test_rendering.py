"""A family whose processor takes the image token in string content gets it where mlx-vlm's prompt_utils
writes it (vision/rendering.py); else its processor finds no placeholder to expand."""

import pytest

from mlxkv.vision import rendering

IMAGE = {"type": "image", "image": "unused"}
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [IMAGE, {"type": "text", "text": "What is it?"}, IMAGE,
                                 {"type": "text", "text": "and"}]},
    {"role": "assistant", "content": "A cat."},
    {"role": "user", "content": [{"type": "text", "text": "And"}, IMAGE]},
]
RENDERED = [*rendering.IMAGE_TOKENS, *rendering.FIRST_IMAGE_ONLY, *rendering.NUMBERED, *rendering.TEXT_ONLY]


@pytest.mark.parametrize("family", RENDERED)
def test_a_family_s_messages_are_rendered_as_mlx_vlm_renders_them(family):
    from mlx_vlm.prompt_utils import apply_chat_template

    parts = [{**m, "content": [{"type": "image"} if p is IMAGE else p for p in m["content"]]
              if isinstance(m["content"], list) else m["content"]} for m in MESSAGES]
    theirs = apply_chat_template(None, {"model_type": family}, parts, return_messages=True, num_images=3)
    assert rendering.template_messages(family, MESSAGES) == theirs


def test_other_families_keep_image_parts_for_their_template():
    assert rendering.template_messages("qwen2_vl", MESSAGES)[3]["content"] == [
        {"type": "text", "text": "And"}, {"type": "image"}]
