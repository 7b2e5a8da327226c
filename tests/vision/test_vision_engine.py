"""Images through mlxkv's engine: greedy tokens equal mlx-vlm's own generate, and the block keys
hold each image's content. One tiny random-weight model per served family (vision/families.py's
SERVED; docs/vision.md says how each one's positions and placeholders differ)."""

import pytest
from vision_cases import make_image

from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.models.loader import load_model
from mlxkv.vision import compat, rendering
from mlxkv.vision.families import SERVED
from mlxkv.vision.prompt import vision_prompt

pytestmark = pytest.mark.slow  # a model to write, and mlx-vlm's generate beside ours
BS = 4
N = 8  # tokens per reply
# Families whose rows take a path another family here already runs through preemption (the whole-prompt
# path of vision/prompt.py, plain positions: InternVL-Chat's; image by image with deepstack and M-RoPE:
# Qwen3-VL's; a twin's classes with another tower or feed-forward: Qwen2-VL's for Qwen2.5-VL, GLM-4V's for
# GLM-4.5V and GLM-OCR, Qwen3-VL's for its MoE, SmolVLM's for Idefics3, Mistral 3's for Pixtral): the suite's
# time goes to the other paths. Kimi K3's rendered chat starts with a fixed 366-token system message, more than
# the preemption pool holds: its path (whole prompt, plain positions, recurrent states) is Nemotron Omni's.
PREEMPTED_ON_ANOTHER_FAMILY = {"internvl", "aya_vision", "llava_onevision", "kimi_vl", "kimi_k25", "mage_vl",
                               "cohere_compass", "muse_glimmer", "llmjpvl", "minicpmo", "qwen3_omni_moe",
                               "qwen2_5_vl", "glm4v_moe", "glm_ocr", "qwen3_vl_moe", "idefics3", "pixtral",
                               "llava", "llava_next", "granite_vision", "kimi_k3"}
# Families whose rows take another family's path for what a test checks beyond the brief's four (equal to
# mlx-vlm, the next turn hits, another image is no hit past the text before it, a batch equals solo runs):
# test -> {family: the family it is checked on}. LLaVA 1.5 embeds as LLaVA-OneVision (the whole-prompt path,
# plain positions), Granite Vision as LLaVA-NeXT (expanded placeholders); a one-image family's text turn
# is its two-turn test's second turn.
CHECKED_ON_ANOTHER_FAMILY = {
    "text_turn": {"llava": "llava_onevision", "llava_next": "its two-turn test",
                  "granite_vision": "its two-turn test"},
    "encoder_cache": {"llava": "llava_onevision", "granite_vision": "llava_next"},
}


def _skip_if_checked_on_another_family(engine, test: str) -> None:
    family = engine.model.vlm.config.model_type
    if family in CHECKED_ON_ANOTHER_FAMILY[test]:
        pytest.skip(f"its path is checked on {CHECKED_ON_ANOTHER_FAMILY[test][family]}")


# Families mlx-vlm embeds one image a request for (vision/expansion.py): a second image is a clear 400.
ONE_IMAGE_A_REQUEST = {"llava_next", "granite_vision"}


def _refused_for_a_second_image(engine, messages) -> bool:
    """True (after checking the refusal) when the engine's family takes one image a request."""
    from mlxkv.errors import MlxkvError

    family = engine.model.vlm.config.model_type
    if family not in ONE_IMAGE_A_REQUEST:
        return False
    with pytest.raises(MlxkvError, match=f"{family} takes one image a request"):
        engine.chat(messages, max_tokens=N)
    return True


@pytest.fixture(scope="module", params=list(SERVED))
def engine(request):
    # Chunks of 8 split the images (12 and 16 tokens): both language models are causal over them in mlx-vlm.
    path = request.getfixturevalue(f"{request.param}_dir")
    with Engine(load_model(str(path)), CacheConfig(block_size=BS), prefill_chunk=8) as engine:
        yield engine


def _user(*parts):
    return {"role": "user", "content": [
        {"type": "image", "image": p} if not isinstance(p, str) else {"type": "text", "text": p} for p in parts]}


def _mlx_vlm(engine, messages, images):
    """mlx-vlm's own greedy reply on the same messages and images."""
    from mlx_vlm.generate.dispatch import stream_generate

    model, processor = engine.model.vlm, engine.model.processor
    # The messages as mlx-vlm's prompt_utils renders them (tests/vision/test_rendering.py: equal to it)
    prompt = compat.render_chat(processor, rendering.template_messages(model.config.model_type, messages))
    inputs = {}
    if compat.passes_text_options_to_images(processor):  # mlx-vlm's own preprocessing fails (LLaVA 1.5)
        given = compat.prepare_inputs(processor, prompt, images)
        inputs = {"input_ids": given["input_ids"], "pixel_values": given["pixel_values"],
                  "mask": given["attention_mask"]}
    return [r.token for r in stream_generate(model, processor, prompt, image=images, max_tokens=N,
                                             temperature=0.0, **inputs)][:N]


def test_one_image_equals_mlx_vlm(engine):
    messages = [_user(make_image(), "What is it?")]
    assert engine.chat(messages, max_tokens=N).tokens == _mlx_vlm(engine, messages, [make_image()])


def test_two_images_in_one_turn_equal_mlx_vlm(engine):
    a, b = make_image(seed=1), make_image(56, 56, seed=2)
    messages = [_user(a, "and", b, "Which is larger?")]
    if _refused_for_a_second_image(engine, messages):
        return
    assert engine.chat(messages, max_tokens=N).tokens == _mlx_vlm(engine, messages, [a, b])


def test_images_in_two_turns_and_the_next_turn_hits_the_first(engine):
    a, b = make_image(seed=3), make_image(seed=4)
    first = [_user(a, "Describe it.")]
    reply = engine.chat(first, max_tokens=N)
    assert reply.tokens == _mlx_vlm(engine, first, [a])
    second = first + [{"role": "assistant", "content": reply.text}, _user(b, "And this one?")]
    if _refused_for_a_second_image(engine, second):
        second = first + [{"role": "assistant", "content": reply.text}, _user("And what else?")]
        b = None
    again = engine.chat(second, max_tokens=N)
    assert again.tokens == _mlx_vlm(engine, second, [a] if b is None else [a, b])
    assert again.stats.cached_tokens["pool"] >= len(reply.prompt_tokens) // BS * BS


def test_a_text_turn_after_the_images_takes_their_rope_delta_from_the_last_turn(engine, monkeypatch):
    """A hit past every image leaves only text to compute: its positions are its indices plus the
    prompt's delta, kept from the turn before (vision/rope_deltas.py), not recomputed by mlx-vlm."""
    _skip_if_checked_on_another_family(engine, "text_turn")
    a = make_image(seed=10)
    first = [_user(a, "Describe it.")]
    reply = engine.chat(first, max_tokens=N)
    second = first + [{"role": "assistant", "content": reply.text}, _user("And now, in more words?")]
    calls = []
    monkeypatch.setattr(compat, "rope_index", lambda *args: calls.append(args) or (None, None))
    again = engine.chat(second, max_tokens=N)
    assert calls == [] and again.stats.cached_image_tokens == again.stats.image_tokens
    assert again.tokens == _mlx_vlm(engine, second, [a])


# MiniCPM-o's processor scales a small image up, past the original size its image_sizes report: b's corner
# is then outside that size (tests/vision/test_padded_images.py), and must still be in b's key.
SMALL_IMAGE = {"minicpmo": (28, 28)}


def test_a_different_image_at_the_same_place_hits_only_the_text_before_it(engine):
    # b differs from a in its lower right corner alone: a tiled image's first tile is the same in both.
    w, h = SMALL_IMAGE.get(engine.model.vlm.config.model_type, (112, 84))
    a = make_image(w, h, seed=5)
    b = a.copy()
    b.paste(make_image(w * 5 // 14, h * 5 // 14, seed=6), (w * 9 // 14, h * 9 // 14))
    engine.chat([_user(a, "What is it?")], max_tokens=N)
    other = [_user(b, "What is it?")]
    result = engine.chat(other, max_tokens=N)
    assert result.tokens == _mlx_vlm(engine, other, [b])
    start = result.prompt_tokens.index(engine.model.image_token_id)
    assert result.stats.cached_tokens["pool"] == start // BS * BS  # the blocks before the image's


def test_a_batch_of_text_and_image_rows_equals_their_solo_runs(engine):
    image_rows = [vision_prompt(engine.model, [_user(make_image(seed=s), "What is it?")]) for s in (7, 8)]
    text_row = engine.apply_chat_template([{"role": "user", "content": "Hello, world! How are you today?"}])
    prompts = [image_rows[0], text_row, image_rows[1]]
    solo = [[c.token for c in engine.stream(p, max_tokens=N, cache_salt="solo")] for p in prompts]
    batch = engine.generate_batch(prompts, max_tokens=N, cache_salt="batch")  # cold: its own chains
    assert [r.tokens for r in batch] == solo
    assert solo[0] != solo[2]  # the two images' rows differ


def test_a_new_conversation_re_sending_an_image_takes_it_from_the_encoder_cache(engine):
    _skip_if_checked_on_another_family(engine, "encoder_cache")
    image = make_image(seed=9)
    engine.chat([_user(image, "What is it?")], max_tokens=N)
    before = engine.stats()["encoder_cache"]
    other = [{"role": "system", "content": "Be brief."}, _user(image, "Name it.")]  # no KV prefix in common
    assert engine.chat(other, max_tokens=N).tokens == _mlx_vlm(engine, other, [image])
    after = engine.stats()["encoder_cache"]
    assert (after["hits"] - before["hits"], after["misses"] - before["misses"]) == (1, 0)


def test_image_rows_preempted_by_a_full_pool_resume_to_their_solo_replies(request, engine):
    """A pool of 30 blocks of 4 tokens holds one or two rows as they grow, not three: rows are preempted
    and resume on their prefix hits, their images' embeddings and positions kept across."""
    family = request.node.callspec.params["engine"]
    if family in PREEMPTED_ON_ANOTHER_FAMILY:
        pytest.skip("its rows take another family's path, preempted there")
    path = request.getfixturevalue(f"{family}_dir")
    rows = [vision_prompt(engine.model, [_user(make_image(seed=s), f"Question {s}?")]) for s in (20, 21, 22)]
    solo = [engine.generate(p, max_tokens=24, cache_salt="solo").tokens for p in rows]
    with Engine(load_model(str(path)), CacheConfig(block_size=BS, num_blocks=30), prefill_chunk=8) as small:
        rows = [vision_prompt(small.model, [_user(make_image(seed=s), f"Question {s}?")]) for s in (20, 21, 22)]
        batch = small.generate_batch(rows, max_tokens=24)
    assert sum(r.stats.preemptions for r in batch) > 0, [(r.finish_reason, r.extra) for r in batch]
    assert [r.tokens for r in batch] == solo


def test_a_deepstack_family_is_never_embedded_whole(cohere_compass_dir, monkeypatch):
    """The whole-prompt path keeps embeddings and positions, not deepstack features: a family with them
    on that path (Cohere Compass without its image-by-image entry) is a clear error, not a wrong reply."""
    from mlxkv.errors import MlxkvError

    monkeypatch.setattr(compat, "per_image_features", lambda model: False)
    with Engine(load_model(str(cohere_compass_dir)), CacheConfig(block_size=BS)) as engine:
        with pytest.raises(MlxkvError, match="cohere_compass: its deepstack features would be dropped"):
            engine.chat([_user(make_image(), "What is it?")], max_tokens=2)
