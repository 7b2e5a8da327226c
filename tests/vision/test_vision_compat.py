"""Every mlx-vlm name mlxkv touches (mlxkv/vision/compat.py): fails here when mlx-vlm changes them."""

import mlx.core as mx
import pytest
from vision_cases import make_image
from mlx_lm.models.cache import KVCache

from mlxkv.vision import compat

pytestmark = pytest.mark.slow  # the tiny model takes ~3 s to write

PARTS = [{"type": "image"}, {"type": "text", "text": "What is it?"}]


def _inputs(processor):
    prompt = processor.apply_chat_template([{"role": "user", "content": PARTS}], add_generation_prompt=True,
                                           tokenize=False)
    return compat.prepare_inputs(processor, prompt, [make_image()])


def test_prepare_inputs_expands_the_placeholder_by_the_grid(qwen2_vl):
    model, processor = qwen2_vl
    inputs = _inputs(processor)
    grid = inputs["image_grid_thw"]
    assert grid.tolist() == [[1, 6, 8]]  # 84x112 pixels in 14x14 patches
    placeholders = (inputs["input_ids"] == compat.vision_token_id(model)).sum().item()
    assert placeholders == 6 * 8 // 4  # merged 2x2


def test_the_language_model_runs_over_mlx_lm_caches_with_m_rope_positions(qwen2_vl):
    model, processor = qwen2_vl
    inputs = _inputs(processor)
    ids = inputs["input_ids"]
    embeds, positions, deltas = compat.input_embeddings(model, ids, inputs["pixel_values"],
                                                        image_grid_thw=inputs["image_grid_thw"])
    assert embeds.shape[:2] == ids.shape and positions.shape == (3, 1, ids.shape[1])
    assert deltas.item() < 0  # the image's 12 tokens take 4 x 3 (h, w) positions
    lm = compat.language_model(model)
    whole = compat.logits(lm(ids, inputs_embeds=embeds, cache=[KVCache() for _ in lm.layers], position_ids=positions))
    caches = [KVCache() for _ in lm.layers]
    cut = 10
    parts = [compat.logits(lm(ids[:, s:e], inputs_embeds=embeds[:, s:e], cache=caches, position_ids=positions[..., s:e]))
             for s, e in ((0, cut), (cut, ids.shape[1]))]
    assert mx.allclose(mx.concatenate(parts, axis=1), whole, atol=1e-4).item()
    text = compat.embed_tokens(model, ids)
    assert text.shape == embeds.shape and not mx.allclose(text, embeds).item()


def test_attention_goes_through_a_module_mlxkv_can_route(qwen2_vl):
    import sys

    model, _ = qwen2_vl
    assert hasattr(sys.modules[compat.attention_module(model)], "scaled_dot_product_attention")


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "gemma3", "glm4v"])
def test_per_image_features_merge_to_what_get_input_embeddings_computes(family, request):
    """The encoder cache keeps compat.vision_features per image; merged back they must equal mlx-vlm's own."""
    import numpy as np

    model, processor = compat.load(str(request.getfixturevalue(f"{family}_dir")))
    images = [make_image(seed=1), make_image(56, 56, seed=2)]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Hi"}]}]
    inputs = compat.prepare_inputs(processor, compat.render_chat(processor, messages), images)
    ids, pixels, grid = inputs["input_ids"], inputs["pixel_values"], inputs.get("image_grid_thw")
    extra = {} if grid is None else {"image_grid_thw": grid}
    whole, positions, _ = compat.input_embeddings(model, ids, pixels, **extra)
    assert (positions is None) == (grid is None)  # M-RoPE families' positions (GLM-4V keeps them inside)
    sizes = [1, 1] if grid is None else [int(np.prod(g)) for g in np.array(grid)]
    bounds = np.cumsum([0] + sizes).tolist()
    features = mx.concatenate([compat.vision_features(model, pixels[bounds[k]:bounds[k + 1]],
                                                      None if grid is None else grid[k:k + 1]) for k in range(2)])
    merged, *_ = compat.input_embeddings_from_features(model, ids, pixels, features, **extra)
    assert mx.allclose(merged, whole, atol=1e-4).item()
    assert compat.vision_token_id(model) in ids.tolist()[0]
    assert compat.processor_settings(processor)  # the settings that key an image's hash
    caches = compat.make_cache(model)
    assert caches is None or len(caches) == len(compat.language_model(model).layers)


def test_a_tiled_images_features_from_its_tiles_merge_to_what_get_input_embeddings_computes(smolvlm_dir):
    """SmolVLM: each image is tiles plus a global view; tile_features of one image's tiles, merged
    back for both images, equal mlx-vlm's own embeddings of the whole prompt."""
    model, processor = compat.load(str(smolvlm_dir))
    images = [make_image(seed=1), make_image(56, 56, seed=2)]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Hi"}]}]
    inputs = compat.prepare_inputs(processor, compat.render_chat(processor, messages), images)
    ids, pixels, mask = inputs["input_ids"], inputs["pixel_values"], inputs["pixel_attention_mask"]
    whole, *_ = compat.input_embeddings(model, ids, pixels, pixel_attention_mask=mask)
    image_token, global_token = compat.vision_token_id(model), compat.global_image_token_id(processor)
    tokens = ids.tolist()[0]
    ends = [i for i in range(1, len(tokens)) if tokens[i - 1] == global_token]  # each image's last tile
    assert len(ends) == 2 and tokens[ends[0]] == image_token
    # A tile is a run of placeholders after a <row_r_col_c> or global token: count them per image.
    runs = [i for i in range(1, len(tokens)) if tokens[i] == image_token and tokens[i - 1] != image_token]
    tiles = [sum(r <= ends[0] for r in runs), sum(r > ends[0] for r in runs)]
    per_tile = processor.image_seq_len
    bounds = [0, tiles[0], tiles[0] + tiles[1]]
    features = mx.concatenate([compat.tile_features(model, mx.full((1, tiles[k] * per_tile), image_token),
                                                    pixels[:, bounds[k]:bounds[k + 1]], mask[:, bounds[k]:bounds[k + 1]])
                               for k in range(2)])
    merged, *_ = compat.input_embeddings_from_features(model, ids, pixels, features, pixel_attention_mask=mask)
    assert mx.allclose(merged, whole, atol=1e-4).item()
    assert tiles[0] > 1  # the first image was cut into tiles


def test_qwen3_vl_deepstack_features_per_image_equal_what_get_input_embeddings_computes(qwen3_vl_dir):
    """Qwen3-VL's tower gives merged features and k deepstack layers' features; mlxkv keeps them per
    image ([1 + k, n, D]) and adds the deepstack ones densely (zeros at text). Both must equal mlx-vlm's."""
    model, processor = compat.load(str(qwen3_vl_dir))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    inputs = compat.prepare_inputs(processor, compat.render_chat(processor, messages), [make_image()])
    ids, pixels, grid = inputs["input_ids"], inputs["pixel_values"], inputs["image_grid_thw"]
    features = model.get_input_embeddings(ids, pixels, image_grid_thw=grid)
    assert compat.deepstack_layers(model) == len(features.deepstack_visual_embeds) == 1
    ours = compat.vision_features(model, pixels, grid)
    assert ours.shape[0] == 2 and mx.allclose(ours[1], features.deepstack_visual_embeds[0], atol=1e-5).item()
    merged, *_ = compat.input_embeddings_from_features(model, ids, pixels, ours[0], image_grid_thw=grid)
    assert mx.allclose(merged, features.inputs_embeds, atol=1e-5).item()
    dense = compat.deepstack_inputs(model, mx.zeros((1, 1, ids.shape[1], ours.shape[-1])))
    assert dense["visual_pos_masks"].shape == ids.shape and dense["deepstack_visual_embeds"][0].shape[0] == ids.shape[1]


def test_mistral3_per_image_features_from_cropped_pixels_merge_to_what_get_input_embeddings_computes(mistral3_dir):
    """Pixtral's processor pads a request's images to the largest; each image's features, from its own
    pixels cropped to its image_sizes, merged back equal mlx-vlm's embeddings of the whole prompt."""
    model, processor = compat.load(str(mistral3_dir))
    images = [make_image(seed=1), make_image(56, 56, seed=2)]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Hi"}]}]
    inputs = compat.prepare_inputs(processor, compat.render_chat(processor, messages), images)
    ids, pixels, sizes = inputs["input_ids"], inputs["pixel_values"], inputs["image_sizes"]
    whole, *_ = compat.input_embeddings(model, ids, pixels, image_sizes=sizes)
    end, image = compat.image_end_token_id(processor), compat.vision_token_id(model)
    tokens = ids.tolist()[0]
    assert tokens.count(end) == 2
    cut = tokens.index(end)
    counts = [tokens[:cut].count(image), tokens[cut:].count(image)]
    features = []
    for k, (h, w) in enumerate(sizes.tolist()):
        features.append(compat.placeholder_features(model, mx.full((1, counts[k]), image),
                                                    pixels[k : k + 1, :, :h, :w], image_sizes=mx.array([[h, w]])))
    merged, *_ = compat.input_embeddings_from_features(model, ids, pixels, mx.concatenate(features), image_sizes=sizes)
    assert mx.allclose(merged, whole, atol=1e-4).item()


def test_llava_is_preprocessed_as_its_processor_means_where_mlx_vlm_s_own_preprocessing_fails(llava_dir):
    """mlx-vlm 0.7.10's LlavaProcessor hands `padding` to its image processor, which transformers rejects;
    compat.prepare_inputs calls it without text options. When mlx-vlm's own call works again, this fails:
    drop compat._without_text_options then. Its pixels are the image processor's, and each `<image>`
    becomes one placeholder a patch (CLS dropped: the "default" strategy)."""
    import numpy as np
    from mlx_vlm.utils import prepare_inputs as mlx_vlm_prepare_inputs

    _, processor = compat.load(str(llava_dir))
    prompt = compat.render_chat(processor, [{"role": "user", "content": [{"type": "image"}, *PARTS]}])
    images = [make_image(seed=1), make_image(56, 56, seed=2)]
    with pytest.raises(ValueError, match="padding"):
        mlx_vlm_prepare_inputs(processor, images=images, prompts=prompt)
    assert compat.passes_text_options_to_images(processor)
    inputs = compat.prepare_inputs(processor, prompt, images, return_tensors="np")
    expected = processor.image_processor(images, return_tensors="np")["pixel_values"]
    assert np.array_equal(inputs["pixel_values"], expected)
    patches = (expected.shape[-1] // 14) ** 2
    assert inputs["input_ids"].tolist()[0].count(processor.image_token_id) == 2 * patches
