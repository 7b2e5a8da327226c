"""Image rows under the quantized pool (kv_bits=8) and beside speculative decoding (lookup, and a
draft model): a batch of image and text rows equals their solo runs under the same config, and an
image row's next request hits its quantized blocks with the same reply. Image rows never take
proposals (lookup would propose placeholder ids); text rows of the same engine still do."""

import pytest
from vision_cases import make_image

from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.models.loader import load_model
from mlxkv.vision.prompt import vision_prompt

pytestmark = pytest.mark.slow  # a vision model, three engines
N = 12


@pytest.fixture(scope="module")
def wide_qwen2_vl(tmp_path_factory):
    """Heads of 32 dimensions: the quantized pool's groups of 32 fit them (the shared tiny one has 16)."""
    from mlxkv.vision.tiny_vlm import write_tiny_vlm

    return write_tiny_vlm(tmp_path_factory.mktemp("models") / "qwen2_vl_128", hidden=128)


def _prompts(engine):
    rows = [vision_prompt(engine.model, [{"role": "user", "content": [
        {"type": "image", "image": make_image(seed=s)}, {"type": "text", "text": "What is it?"}]}]) for s in (1, 2)]
    text = engine.apply_chat_template([{"role": "user", "content": "Hello, world! hello hello hello"}])
    return [rows[0], text, rows[1]]


@pytest.mark.parametrize("config", [dict(kv_bits=8, kv_group_size=32), dict(speculative="lookup"),
                                    dict(speculative="draft")], ids=["kv_bits=8", "lookup", "draft"])
def test_image_rows_equal_their_solo_runs(wide_qwen2_vl, config):
    if config.get("speculative") == "draft":  # the model drafts for itself: every text proposal is accepted
        config = {**config, "draft_model": str(wide_qwen2_vl)}
    cache = CacheConfig(block_size=4, num_blocks=256, memory_tier_bytes=0, **config)
    with Engine(load_model(str(wide_qwen2_vl)), cache, prefill_chunk=8) as engine:
        assert engine.stats()["kv_format"] == ("q8g32" if "kv_bits" in config else "float32")
        prompts = _prompts(engine)
        solo = [engine.generate(p, max_tokens=N, cache_salt="solo") for p in prompts]
        batch = engine.generate_batch(prompts, max_tokens=N, cache_salt="batch")  # cold: its own chains
        assert [r.tokens for r in batch] == [r.tokens for r in solo]
        assert solo[0].tokens != solo[2].tokens  # the two images' rows differ
        again = engine.generate(prompts[0], max_tokens=N, cache_salt="solo")  # a hit on its image's blocks
        assert again.tokens == solo[0].tokens and again.stats.cached_image_tokens == again.stats.image_tokens
        assert [r.stats.proposed_tokens for r in (solo[0], solo[2], again)] == [0, 0, 0]  # image rows: none
        if "speculative" in config:
            assert solo[1].stats.proposed_tokens > 0  # the text row speculates
