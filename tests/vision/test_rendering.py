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


def _rendered_as_joined_text(monkeypatch):
    """A processor's template stood in for by its messages' contents in a row: what reaches the text."""
    monkeypatch.setattr(rendering.compat, "render_chat",
                        lambda processor, messages: "".join(str(m["content"]) for m in messages))


def test_an_image_outside_a_user_message_is_refused_where_mlxkv_writes_the_token(monkeypatch):
    """Its token would be dropped from the text, and MiniCPM-o's processor would put the image's features at
    the prompt's start. A family whose template takes image parts places (or refuses) them itself."""
    from mlxkv.errors import MlxkvError

    _rendered_as_joined_text(monkeypatch)
    for role in ("assistant", "tool", "system"):
        messages = [{"role": "user", "content": "Hi"},
                    {"role": role, "content": [{"type": "text", "text": "r"}, IMAGE]}]
        with pytest.raises(MlxkvError, match=f"^messages.1.content.1: an image in a message of role '{role}'"):
            rendering.render(None, "minicpmo", messages)
        assert rendering.render(None, "qwen2_vl", messages)


def test_an_image_token_in_a_message_s_text_is_refused(monkeypatch):
    """A literal image token in a system prompt, a tool's output or the user's text would take the image."""
    from mlxkv.errors import MlxkvError

    _rendered_as_joined_text(monkeypatch)
    image = {"role": "user", "content": [IMAGE, {"type": "text", "text": "Hi"}]}
    for family, text in (("minicpmo", "what is <image>?"), ("phi3_v", "<|image_2|> again")):
        assert rendering.render(None, family, [image])
        for message in ({"role": "system", "content": text}, {"role": "tool", "content": text},
                        {"role": "user", "content": [{"type": "text", "text": text}]}):
            with pytest.raises(MlxkvError, match=f"^messages: {family}'s image token is in the prompt 2 times"):
                rendering.render(None, family, [message, image])
