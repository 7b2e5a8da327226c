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
