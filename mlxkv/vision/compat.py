"""The one place mlxkv touches mlx-vlm (the `vision` extra).

Every mlx-vlm name mlxkv uses goes through here: its loader, its model
classes, the split of a model into vision tower + `get_input_embeddings`
and a language model that takes mlx-lm's cache protocol, the language
model's output type, and Qwen's M-RoPE index. When mlx-vlm changes one of
them, tests/vision/test_vision_compat.py fails here, not downstream with a wrong
answer.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging

import mlx.core as mx

log = logging.getLogger(__name__)


def available() -> bool:
    """Whether mlx-vlm is importable (`pip install -e '.[vision]'`)."""
    return importlib.util.find_spec("mlx_vlm") is not None


def build_model(config: dict):
    """An mlx-vlm model of `config` with its initial weights, configured as mlx-vlm's loader does."""
    import copy

    from mlx_vlm.utils import get_model_and_args, update_module_configs

    config = copy.deepcopy(config)
    arch, _ = get_model_and_args(config=config)
    config.setdefault("text_config", {})
    config.setdefault("vision_config", {})
    model_config = arch.ModelConfig.from_dict(config)
    model_config = update_module_configs(model_config, arch, config, ["text", "vision", "perceiver", "projector"])
    return arch.Model(model_config)


def model_type(config: dict) -> str | None:
    """The family mlx-vlm's loader picks for `config`: its model_type lowercased and remapped
    (`unlimited-ocr` is unlimited_ocr, `nemotron_h_omni` nemotron_h_nano_omni).

    Imports mlx-vlm (seconds): call it only for a checkpoint mlx-vlm will load anyway."""
    from mlx_vlm.utils import get_model_type

    return get_model_type(config)


def load(path: str):
    """(model, processor) through mlx-vlm's own loader: its sanitize, its processor classes."""
    from mlx_vlm.utils import load as mlx_vlm_load

    return mlx_vlm_load(path)


def language_model(model):
    """The part that runs over a KV cache: `(ids, inputs_embeds=, cache=, position_ids=)` -> output."""
    return model.language_model


def logits(output):
    """The logits array of a language model's output (mlx-vlm wraps it in LanguageModelOutput)."""
    return getattr(output, "logits", output)


def input_embeddings(model, input_ids, pixel_values, **image_inputs):
    """(inputs_embeds [1, L, D], position_ids or None, rope_deltas or None) of a prompt with its images."""
    import inspect

    if "mask" in inspect.signature(model.get_input_embeddings).parameters:  # Gemma 3 merges with a padding mask
        image_inputs = {"mask": mx.ones(input_ids.shape, mx.int32), **image_inputs}
    pixel_values, image_inputs = _batched(model, pixel_values, image_inputs)
    features = model.get_input_embeddings(input_ids, pixel_values, **image_inputs)
    positions, deltas = getattr(features, "position_ids", None), getattr(features, "rope_deltas", None)
    if positions is None and image_inputs.get("image_grid_thw") is not None:
        # GLM-4V keeps its M-RoPE positions inside its language model instead of returning them.
        positions, deltas = rope_index(model, input_ids, image_inputs["image_grid_thw"])
    return features.inputs_embeds, positions, deltas


def rope_index(model, input_ids, grid):
    """(position_ids, rope_deltas) of a prompt from its ids and image grids alone (Qwen's M-RoPE;
    (None, None) for families with plain positions): no vision tower needed."""
    language = model.language_model
    if not hasattr(language, "get_rope_index") or getattr(model.config, "model_type", None) in _PLAIN_POSITIONS:
        return None, None
    return language.get_rope_index(input_ids, grid)


# Families whose language model is an M-RoPE one given plain positions, the same on its three axes:
# MiniCPM-o's (Qwen3-VL's language model; its get_input_embeddings sets arange positions, no image grid).
# MiniMax-M3-VL's (its get_rope_index is an arange whatever the grid).
_PLAIN_POSITIONS = ("minicpmo", "minimax_m3_vl")
# Families whose language model takes plain positions as one [B, L] axis, not M-RoPE's [3, B, L]:
# MiniMax-M3-VL's attention reads a 3-axis array's first axis as its rotary offsets.
_ONE_AXIS_POSITIONS = ("minimax_m3_vl",)


def language_positions(model, position_ids):
    """`position_ids` [3, B, L] (mlxkv's rows) as `model`'s language model takes them."""
    if position_ids is not None and getattr(model.config, "model_type", None) in _ONE_AXIS_POSITIONS:
        return position_ids[0]
    return position_ids


def _embedding(model):
    """The language model's token embedding (Idefics3's sits on the language model itself; Nemotron-H's
    is its backbone's `embeddings`)."""
    language = model.language_model
    for inner in (getattr(language, "model", None), getattr(language, "backbone", None), language):
        if inner is not None and "embed_tokens" in inner:
            return inner.embed_tokens
    return language.backbone.embeddings


def embed_tokens(model, input_ids):
    """The language model's token embedding (text positions of any row), normalized where its
    get_input_embeddings normalizes it (Muse Glimmer's embed_norm)."""
    language = model.language_model
    norm = getattr(getattr(language, "model", language), "embed_norm", None)
    embeds = _embedding(model)(input_ids)
    return embeds if norm is None else norm(embeds)


def attention_module(model):
    """The module whose `scaled_dot_product_attention` the language model's layers call."""
    return type(model.language_model).__module__


# Families whose config names no placeholder token: the token their processor writes for an image's
# features (MiniCPM-o's resampled queries sit over `<unk>`s between `<image>` and `</image>`).
_PLACEHOLDER_TOKENS = {"minicpmo": "<unk>"}


def _config(model):
    """The config that holds the vision fields: Qwen3-Omni's thinker's (its talker's beside it)."""
    return getattr(model.config, "thinker_config", None) or model.config


def _vision_tower(model):
    thinker = getattr(model, "thinker", None)
    return model.vision_tower if thinker is None else thinker.vision_tower


def vision_token_id(model, processor=None) -> int | None:
    """The placeholder id an image's tokens take (Gemma 3 calls it image_token_index)."""
    config = _config(model)
    token = _PLACEHOLDER_TOKENS.get(getattr(config, "model_type", None))
    if token is not None and processor is not None:
        return processor.tokenizer.convert_tokens_to_ids(token)
    return getattr(config, "image_token_id", None) or getattr(config, "image_token_index", None)


def make_cache(model) -> list | None:
    """The language model's own cache objects (sliding layers' RotatingKVCache), or None: one KVCache a layer."""
    language = model.language_model
    return language.make_cache() if hasattr(language, "make_cache") else None


def render_chat(processor, messages: list[dict]) -> str:
    """The prompt text: the processor's chat template, else its tokenizer's (Gemma 3's processor has none)."""
    if getattr(processor, "chat_template", None):
        return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def prepare_inputs(processor, prompt: str, images: list, **kwargs) -> dict:
    """mlx-vlm's preprocessing: ids with the placeholders expanded, pixel_values, grids, as mx arrays."""
    from mlx_vlm.utils import prepare_inputs as mlx_vlm_prepare_inputs

    if images and passes_text_options_to_images(processor):
        return _without_text_options(processor, prompt, images, kwargs.get("return_tensors", "mlx"))
    return mlx_vlm_prepare_inputs(processor, images=images, prompts=prompt, **kwargs)


def passes_text_options_to_images(processor) -> bool:
    """mlx-vlm 0.7.10's LlavaProcessor hands every option it is called with, the text ones too
    (`padding`, which mlx-vlm's prepare_inputs always sends), to its image processor; the installed
    transformers validates an image processor's options and rejects them."""
    cls = type(processor)
    return cls.__name__ == "LlavaProcessor" and cls.__module__.startswith("mlx_vlm.")


def _without_text_options(processor, prompt: str, images: list, return_tensors: str) -> dict:
    """What prepare_inputs returns for a processor that passes_text_options_to_images: the processor
    called with no options, as its checkpoint means (one prompt needs no padding). Its __call__ still
    does its own work: the image processor, then `<image>` expanded to the patch count and tokenized."""
    import numpy as np

    out = processor(text=[prompt], images=images)
    arrays = {k: np.asarray(v) for k, v in out.items()}
    arrays.setdefault("attention_mask", np.ones_like(arrays["input_ids"]))
    return arrays if return_tensors == "np" else {k: mx.array(v) for k, v in arrays.items()}


# Families whose processor returns a list a prompt where others return a batch's arrays (MiniCPM-o: each
# image its own size), and the inputs of media mlxkv does not send (kept out of get_input_embeddings, which
# would run its absent audio tower on an empty batch).
_PROMPT_LISTS = {"minicpmo": ("pixel_values", "tgt_sizes", "image_bound", "image_sizes")}
_UNSENT_MEDIA = {"minicpmo": ("audio_features", "audio_feature_lens", "audio_bounds", "spk_bounds")}


def prompt_inputs(model, inputs: dict) -> dict:
    """prepare_inputs' output of one prompt with its per-prompt lists unwrapped: a list (or array) an image.
    MLX arrays become numpy here, evaluated on the thread that built them, not later on the engine's stream
    (DeepSeek-VL2's processor returns lazy ones: mlx-vlm's own generate, which reads them on its stream, gave
    other replies from call to call)."""
    import numpy as np

    family = getattr(model.config, "model_type", None)
    out = {k: np.asarray(v) if isinstance(v, mx.array) else v for k, v in inputs.items()
           if k not in _UNSENT_MEDIA.get(family, ())}
    for name in _PROMPT_LISTS.get(family, ()):
        if out.get(name) is not None:
            out[name] = out[name][0]
    return out


def _batched(model, pixel_values, image_inputs: dict):
    """The inverse of prompt_inputs for get_input_embeddings: a batch of one prompt's lists."""
    names = _PROMPT_LISTS.get(getattr(model.config, "model_type", None), ())
    if "pixel_values" in names:
        pixel_values = [pixel_values]
    return pixel_values, {k: [v] if k in names else v for k, v in image_inputs.items()}


# The image processor's settings that change pixel_values: part of an image's hash.
_PROCESSOR_SETTINGS = ("min_pixels", "max_pixels", "size", "patch_size", "merge_size", "temporal_patch_size",
                       "image_mean", "image_std", "rescale_factor", "do_resize", "do_rescale", "do_normalize",
                       "do_convert_rgb", "resample", "image_seq_length", "do_image_splitting", "max_image_size")


# The processor's per-image outputs beside pixel_values (a row an image) that change what an image's
# pixels mean: Kimi-VL's patch grid (the same patches in 2 x 8 or 4 x 4 are different images),
# LLaVA-OneVision's size (which AnyRes tiles are real). Part of an image's hash.
_PER_IMAGE_INPUTS = ("image_grid_hws", "grid_thws", "image_sizes", "tgt_sizes")  # grid_thws: Kimi K3's grid,
# tgt_sizes: MiniCPM-o's patch grid of each slice


# Families whose `image_sizes` are each image's (h, w) within pixel_values padded to the request's largest
# image (Pixtral's processor): an image's pixels are then that crop. Elsewhere image_sizes mean something
# else (MiniCPM-o's: the original image's (w, h), before its processor scales it up or down), so a crop by
# them would leave pixels out of the image's key and two images would share it.
_PADDED_IMAGE_SIZES = ("mistral3", "pixtral")


def padded_image_sizes(model) -> bool:
    """True when the family's image_sizes are the (h, w) crop of each image in its padded pixel_values."""
    return getattr(model.config, "model_type", None) in _PADDED_IMAGE_SIZES


def per_image_inputs(inputs: dict, count: int) -> list:
    """Per image, its values of _PER_IMAGE_INPUTS in `inputs` (prepare_inputs' output), flattened."""
    import numpy as np

    present = [np.asarray(inputs[name]) for name in _PER_IMAGE_INPUTS if inputs.get(name) is not None]
    present = [a for a in present if a.ndim >= 1 and len(a) == count]
    return [np.concatenate([a[k].ravel() for a in present]) if present else None for k in range(count)]


def processor_settings(processor) -> dict:
    image_processor = getattr(processor, "image_processor", processor)
    return {name: getattr(image_processor, name) for name in _PROCESSOR_SETTINGS if hasattr(image_processor, name)}


def deepstack_layers(model) -> int:
    """How many of the language model's first layers take deepstack features (Qwen3-VL: the vision
    tower's middle layers' output, added to those layers' hidden states at image tokens); 0 for
    families without."""
    vision_config = getattr(_config(model), "vision_config", None)
    return len(getattr(vision_config, "deepstack_visual_indexes", None) or ())


def deepstack_inputs(model, embeds: mx.array) -> dict:
    """The language model's deepstack arguments of a forward, `embeds` [k, B, L, D] dense (zeros at
    text positions, so adding them everywhere leaves text hidden states as they are)."""
    k, b, n, d = embeds.shape
    if getattr(model.config, "thinker_config", None) is not None:  # Qwen3-Omni's: one [B, L, k, D] residual
        return {"visual_pos_masks": mx.ones((b, n), mx.bool_), "deepstack_visual_embeds": embeds.transpose(1, 2, 0, 3)}
    return {"visual_pos_masks": mx.ones((b, n), mx.bool_),
            "deepstack_visual_embeds": [embeds[i].reshape(b * n, d) for i in range(k)]}


def vision_features(model, pixel_values, grid):
    """What get_input_embeddings merges in for one image: Qwen's vision tower output for its pixel
    rows and grid, Gemma 3's projected tower output for its [1, C, H, W] pixels (grid None).
    (Tiled families: tile_features.) Qwen3-VL's: [1 + k, n, D], its k deepstack layers' features
    after the merged ones."""
    if grid is None:
        hidden, _, _ = model.vision_tower(pixel_values.transpose(0, 2, 3, 1).astype(_embed_dtype(model)),
                                          output_hidden_states=True)
        return model.multi_modal_projector(hidden)
    tower = _vision_tower(model)
    out = tower(pixel_values.astype(tower.patch_embed.proj.weight.dtype), grid, output_hidden_states=False)
    if not isinstance(out, tuple):
        return out
    features, deepstack = out  # Qwen3-VL's towers (Qwen3.5's too, its deepstack list empty)
    return mx.stack([features, *deepstack]) if deepstack_layers(model) else features


def _embed_dtype(model):
    return _embedding(model).weight.dtype


def global_image_token_id(processor) -> int | None:
    """The token before a tiled image's last tile, its global view (SmolVLM, Idefics3); None for
    families that do not tile: there one run of placeholder tokens is one image."""
    token = getattr(processor, "global_image_token", None) or getattr(processor, "global_image_tag", None)
    if token is None:
        return None
    return processor.tokenizer.convert_tokens_to_ids(token)


def image_end_token_id(processor) -> int | None:
    """The token after an image's last run of placeholders (Pixtral's, Mistral 3's [IMG_END]; Aya Vision's
    and Llama 4's, after their global view): the runs before it, rows or tiles, are one image. None for
    families whose image is one run."""
    token = getattr(processor, "end_of_img_token", None)  # Aya Vision's, Llama 4's
    if token is not None:
        return processor.tokenizer.convert_tokens_to_ids(token)
    return getattr(processor, "image_end_token_id", None)


def placeholder_features(model, input_ids, pixel_values, **image_inputs):
    """One image's merged features [n, D]: `input_ids` its n placeholder tokens alone. mlx-vlm's
    get_input_embeddings puts the tower's projected output at every placeholder, so its embeddings of an
    all-placeholder prompt are the image's features (Mistral 3's, with its `image_sizes`)."""
    return model.get_input_embeddings(input_ids, pixel_values, **image_inputs).inputs_embeds[0]


# Families embedded image by image (vision_features, tile_features, placeholder_features with their own
# inputs), so the encoder cache spares the tower an image already seen beside a new one. Any other family
# is embedded whole by its get_input_embeddings with all its processor's inputs, or by merged_embeddings
# when every image is in the encoder cache (vision/prompt.py).
_PER_IMAGE = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "glm4v_moe", "gemma3", "smolvlm",
              "idefics3", "idefics2", "mistral3", "pixtral", "cohere_compass", "qwen3_omni_moe")


def per_image_features(model) -> bool:
    return getattr(model.config, "model_type", None) in _PER_IMAGE


def merged_embeddings(model, input_ids, features, image_token: int | None = None):
    """[1, L, D]: the prompt's token embeddings with `features` [n, D] at its n placeholders, in order:
    what get_input_embeddings computes for a family that writes an image's features over its
    placeholders (LLaVA-style merges), with no vision tower run."""
    import numpy as np

    embeds = embed_tokens(model, input_ids)
    image_token = vision_token_id(model) if image_token is None else image_token
    at = mx.array(np.flatnonzero(np.array(input_ids[0]) == image_token))
    embeds[:, at] = features.astype(embeds.dtype)
    return embeds


def tile_features(model, input_ids, pixel_values, pixel_mask):
    """A tiled image's merged features [n, D]: `input_ids` its n placeholder tokens alone, its tiles'
    [1, T, C, H, W] pixels and [1, T, H, W] mask. get_input_embeddings puts the tower's output at
    every placeholder, so its embeddings of an all-placeholder prompt are the image's features."""
    features = model.get_input_embeddings(input_ids, pixel_values, pixel_attention_mask=pixel_mask)
    return features.inputs_embeds[0]


def input_embeddings_from_features(model, input_ids, pixel_values, features, **image_inputs):
    """As input_embeddings, with the vision tower's output given (mlx-vlm's `cached_image_features`)."""
    return input_embeddings(model, input_ids, pixel_values, cached_image_features=features, **image_inputs)
