"""The chat app's `/image PATH`: stored as typed, sent as an image part, through the engine thread's path."""

import pytest
from vision_cases import make_image

from mlxkv.chat.image_command import check_images, content_parts, split_images
from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.errors import MlxkvError
from mlxkv.tui.store import ChatStore, Message
from mlxkv.vision.prompt import VisionPrompt


def test_leading_image_lines_become_image_parts_and_the_rest_stays_text():
    assert split_images("/image ~/a.png\n/image '/b c.png'\nWhat are they?") == (
        [str(__import__("pathlib").Path("~/a.png").expanduser()), "/b c.png"], "What are they?")
    assert content_parts("no images /image x") == "no images /image x"
    assert content_parts("/image x.png\nhi") == [{"type": "image", "image": "x.png"}, {"type": "text", "text": "hi"}]
    with pytest.raises(MlxkvError, match="/image: no such file: /nowhere.png"):
        check_images("/image /nowhere.png\nhi")


@pytest.mark.slow  # loads a model
def test_a_chat_with_an_image_command_replies_as_with_an_image_part(qwen2_vl_dir, tmp_path):
    make_image().save(tmp_path / "a.png")
    store = ChatStore(":memory:")
    chat = store.create()
    store.add_message(chat.id, Message("user", f"/image {tmp_path / 'a.png'}\nWhat is it?"))
    messages = store.prompt_messages(chat.id)
    with Engine.load(str(qwen2_vl_dir), CacheConfig(block_size=4)) as engine:
        prompt, left_out = engine.chat_prompt(messages)  # what the engine thread does with a chat's messages
        assert isinstance(prompt, VisionPrompt) and left_out == 0
        parts = [{"role": "user", "content": [{"type": "image", "image": make_image()},
                                              {"type": "text", "text": "What is it?"}]}]
        assert engine.generate(prompt, max_tokens=6).tokens == engine.chat(parts, max_tokens=6).tokens


def test_attach_image_adds_a_quoted_image_line_after_the_leading_ones(tmp_path, monkeypatch):
    from mlxkv.chat.image_command import attach_image

    (tmp_path / "a b.png").write_bytes(b"x")
    (tmp_path / "c.png").write_bytes(b"x")
    spaced = str(tmp_path / "a b.png")
    assert attach_image("", spaced) == f"/image '{spaced}'"
    assert attach_image("", spaced.replace(" ", "\\ ")) == f"/image '{spaced}'"  # as a terminal pastes a drop
    first = attach_image("What are they?", f"'{spaced}'")
    both = attach_image(first, str(tmp_path / "c.png"))
    assert both == f"/image '{spaced}'\n/image {tmp_path / 'c.png'}\nWhat are they?"
    assert split_images(both) == ([spaced, str(tmp_path / "c.png")], "What are they?")
    with pytest.raises(MlxkvError, match="/image: no such file: /nowhere.png"):
        attach_image("hi", "/nowhere.png")
    monkeypatch.chdir(tmp_path)
    assert attach_image("", "c.png") == f"/image {tmp_path / 'c.png'}"  # kept absolute


def test_the_cache_panel_names_an_images_tokens_and_whether_they_were_cached():
    from mlxkv.tui.widgets.turn_stats import image_line

    assert image_line(12, 12) == "image: 12 tokens, cached"
    assert image_line(12, 0) == "image: 12 tokens, computed"
    assert image_line(1200, 800) == "image: 1,200 tokens, 800 cached"
