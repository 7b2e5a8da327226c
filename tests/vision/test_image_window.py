"""A chat with images longer than the context loses its oldest turns whole: never part of an image."""

import pytest
from vision_cases import make_image

from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.errors import MlxkvError
from mlxkv.models.loader import load_model
from mlxkv.vision.images import image_parts
from mlxkv.vision.prompt import vision_prompt

pytestmark = pytest.mark.slow  # a vision model to load


@pytest.fixture(scope="module")
def small(qwen2_vl_dir):
    """A pool of 40 blocks of 4 tokens: a prompt fits in 160 tokens less its reply's room."""
    with Engine(load_model(str(qwen2_vl_dir)), CacheConfig(block_size=4, num_blocks=40)) as engine:
        yield engine


def _chat(turns: int) -> list[dict]:
    chat = []
    for k in range(turns):
        chat.append({"role": "user", "content": [{"type": "image", "image": make_image(seed=30 + k)},
                                                 {"type": "text", "text": f"Picture {k}: what is in it?"}]})
        chat.append({"role": "assistant", "content": f"It is picture number {k}, of noise."})
    return chat + [{"role": "user", "content": [{"type": "image", "image": make_image(seed=40)},
                                                {"type": "text", "text": "And this last one?"}]}]


def test_an_image_chat_over_the_context_drops_whole_image_turns(small):
    chat = _chat(5)
    whole = vision_prompt(small.model, chat)
    limit = small.limits.prompt_limit(8)
    assert len(whole) > limit
    with pytest.raises(MlxkvError, match="blocks"):  # not fitted: refused
        small.generate(whole, max_tokens=8)
    prompt, left_out = small.chat_prompt(chat, max_tokens=8, fit=True)
    assert left_out > 0 and left_out % 2 == 0 and len(prompt) <= limit  # whole turns, from a user message on
    kept = chat[left_out:]
    assert prompt.tokens == vision_prompt(small.model, kept).tokens
    assert [s.length for s in prompt.spans] == [12] * len(image_parts(kept))  # each kept image whole
    reply = small.generate(prompt, max_tokens=8)
    assert reply.stats.image_tokens == 12 * len(image_parts(kept)) and len(reply.tokens) == 8


def test_an_image_chat_within_the_context_is_sent_whole(small):
    chat = _chat(1)
    prompt, left_out = small.chat_prompt(chat, max_tokens=8, fit=True)
    assert left_out == 0 and prompt.tokens == vision_prompt(small.model, chat).tokens
