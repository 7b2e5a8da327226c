"""An image conversation after a restart: its blocks come back from the SSD tier, keyed by the image."""

import pytest
from vision_cases import make_image

from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.models.loader import load_model

pytestmark = pytest.mark.slow  # two engines, one after the other
N = 6


def _user(image, text):
    return {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}


def test_after_a_restart_the_image_turn_is_restored_from_the_ssd_tier(qwen2_vl_dir, tmp_path):
    config = CacheConfig(block_size=4, disk_tier=str(tmp_path / "ssd"))
    first = [_user(make_image(seed=11), "What is it?")]
    with Engine(load_model(str(qwen2_vl_dir)), config) as engine:
        cold = engine.chat(first, max_tokens=N)
    second = first + [{"role": "assistant", "content": cold.text}, {"role": "user", "content": "Say more."}]
    with Engine(load_model(str(qwen2_vl_dir)), config) as engine:
        warm = engine.chat(second, max_tokens=N)
        assert engine.stats()["encoder_cache"]["misses"] == 0  # the hit covers the image: no vision tower
        other = engine.chat([_user(make_image(seed=12), "What is it?")], max_tokens=N)
        assert engine.stats()["encoder_cache"]["misses"] == 1
    with Engine(load_model(str(qwen2_vl_dir)), CacheConfig(block_size=4)) as engine:
        assert engine.chat(second, max_tokens=N).tokens == warm.tokens  # equal to a cold run
    assert warm.stats.cached_tokens["disk"] >= (len(cold.prompt_tokens) - 1) // 4 * 4
    image_start = cold.prompt_tokens.index(engine.model.image_token_id)
    assert sum(other.stats.cached_tokens.values()) == image_start // 4 * 4  # another image: the text before it


def test_another_process_s_engine_finds_the_image_turn_in_the_redis_tier(qwen2_vl_dir, redis_server):
    server = redis_server()
    config = CacheConfig(block_size=4, remote_tier=server.url, memory_tier_bytes=0)
    first = [_user(make_image(seed=13), "What is it?")]
    with Engine(load_model(str(qwen2_vl_dir)), config) as engine:
        cold = engine.chat(first, max_tokens=N)
    with Engine(load_model(str(qwen2_vl_dir)), config) as engine:  # as another machine's would
        warm = engine.chat(first, max_tokens=N)
        other = engine.chat([_user(make_image(seed=14), "What is it?")], max_tokens=N)
    assert warm.tokens == cold.tokens
    assert warm.stats.cached_tokens["remote"] == (len(cold.prompt_tokens) - 1) // 4 * 4
    image_start = cold.prompt_tokens.index(engine.model.image_token_id)
    assert sum(other.stats.cached_tokens.values()) == image_start // 4 * 4
