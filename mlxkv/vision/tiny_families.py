"""The tiny vision model of each family: the table tiny_vlm.py reads, and the configs of the
families mlx-vlm embeds on the whole-prompt path (prompt.py). tiny_configs.py holds the
image-by-image families' configs and what both share (templates, preprocessors, `_as_family`);
tiny_kimi.py the Kimi family's."""

from __future__ import annotations

from mlxkv.models.tiny import SPECIAL_TOKENS
from mlxkv.vision.tiny_configs import (COHERE_COMPASS_VISION_TOKENS, GEMMA3_PREPROCESSOR, GEMMA3_TEMPLATE,
                                       GEMMA3_VISION_TOKENS, GLM4V_VISION_TOKENS, IDEFICS3_PREPROCESSOR,
                                       MISTRAL3_PREPROCESSOR, MISTRAL3_TEMPLATE, MISTRAL3_VISION_TOKENS, PREPROCESSOR,
                                       QWEN3_VL_PREPROCESSOR, QWEN_VISION_TOKENS, QWEN_VL_TEMPLATE,
                                       SMOLVLM_PREPROCESSOR, SMOLVLM_TEMPLATE, SMOLVLM_TILE, SMOLVLM_VISION_TOKENS,
                                       _as_family, cohere_compass_config, gemma3_config, glm4v_config,
                                       glm4v_moe_config, idefics2_config, idefics3_config, mistral3_config,
                                       pixtral_config, qwen2_5_vl_config, qwen2_vl_config, qwen3_vl_config,
                                       qwen3_vl_moe_config, smolvlm_config)
from mlxkv.vision.tiny_kimi import (KIMI_K3_VISION_TOKENS, KIMI_VL_PREPROCESSOR, KIMI_VL_TEMPLATE,
                                    KIMI_VL_VISION_TOKENS, kimi_k3_config, kimi_k25_config, kimi_vl_config)


def mage_vl_config(vocab_size: int, ids: dict[str, int], hidden: int = 64, layers: int = 2, seed: int = 0,
                   **_) -> dict:
    """Mage-VL: Qwen's placeholders and Qwen3-VL's image processor (16-pixel patches merged 2 x 2, one
    frame), its own tower, and a Qwen3 language model."""
    base = qwen2_vl_config(vocab_size, ids, hidden, layers, seed)
    text = {"model_type": "qwen3", "hidden_size": hidden, "num_hidden_layers": layers,
            "intermediate_size": 2 * hidden, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": hidden // 4, "rms_norm_eps": 1e-6, "vocab_size": vocab_size, "rope_theta": 10000.0,
            "max_position_embeddings": 4096, "tie_word_embeddings": False}
    return {
        **{k: base[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                "vision_end_token_id", "eos_token_id")},
        "model_type": "mage_vl", "architectures": ["MageVLForConditionalGeneration"], "text_config": text,
        "vocab_size": vocab_size, "tie_word_embeddings": False,
        "vision_config": {"model_type": "mage_vl_vision", "hidden_size": 64, "num_hidden_layers": 1,
                          "num_attention_heads": 2, "intermediate_size": 128, "patch_size": 16,
                          "spatial_merge_size": 2, "temporal_patch_size": 1, "out_hidden_size": hidden,
                          "text_hidden_size": hidden},
        "mlxkv_tiny_model": {"family": "mage_vl", "hidden_size": hidden, "num_layers": layers, "seed": seed},
    }


MINIMAX_M3_VL_VISION_TOKENS = ["]<]image[>[", "]<]video[>[", "]<]start of image[>[", "]<]end of image[>["]


def minimax_m3_vl_config(vocab_size: int, ids: dict[str, int], hidden: int = 64, layers: int = 2, seed: int = 0,
                         **_) -> dict:
    """MiniMax-M3-VL: Qwen-style patches (14 px, 2 x 2 merged after projection) written over
    `]<]image[>[` between its start and end tokens; a MiniMax-M3 (a dense layer then experts, a block
    indexer on its sparse layers) at plain positions."""
    from mlxkv.models.tiny_args import family_args

    text = {**family_args("minimax_m3_vl")["text_config"], "hidden_size": hidden, "num_hidden_layers": layers,
            "vocab_size": vocab_size, "mlp_layer_types": ["dense", "sparse"][:layers],
            "sparse_attention_freq": [0, 1][:layers]}
    return {
        "model_type": "minimax_m3_vl", "architectures": ["MiniMaxM3VLForConditionalGeneration"],
        "text_config": text, "vocab_size": vocab_size,
        "vision_config": {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                          "num_attention_heads": 2, "num_hidden_layers": 1, "patch_size": 14, "image_size": 224,
                          "projection_dim": hidden},
        "projector_hidden_size": hidden,
        "image_token_index": ids["]<]image[>["], "video_token_index": ids["]<]video[>["],
        "vision_start_token_id": ids["]<]start of image[>["], "vision_end_token_id": ids["]<]end of image[>["],
        "eos_token_id": [SPECIAL_TOKENS.index("<|im_end|>")],
        "mlxkv_tiny_model": {"family": "minimax_m3_vl", "hidden_size": hidden, "num_layers": layers, "seed": seed},
    }


MUSE_GLIMMER_VISION_TOKENS = ["<|patch|>", "<|image_start|>", "<|image_end|>", "<|video|>"]


def muse_glimmer_config(vocab_size: int, ids: dict[str, int], hidden: int = 64, layers: int = 2, seed: int = 0,
                        **_) -> dict:
    """Muse Glimmer: `<|patch|>` x (h * w / 4 patches of 14 px) between `<|image_start|>` and
    `<|image_end|>`; a sliding layer with rope then a full one without (its last layer is full)."""
    text = {"model_type": "muse_glimmer_text", "vocab_size": vocab_size, "hidden_size": hidden,
            "intermediate_size": 2 * hidden, "num_hidden_layers": layers, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": hidden // 4, "sliding_window": 16,
            "max_position_embeddings": 4096}
    return {
        "model_type": "muse_glimmer", "architectures": ["MuseGlimmerForConditionalGeneration"],
        "text_config": text, "vocab_size": vocab_size,
        "vision_config": {"model_type": "muse_glimmer_vision", "patch_size": 14, "merge_size": 2,
                          "pos_emb_height": 8, "pos_emb_width": 8, "hidden_size": 32, "intermediate_size": 64,
                          "num_attention_heads": 2, "num_hidden_layers": 1},
        "image_token_id": ids["<|patch|>"], "video_token_id": ids["<|video|>"], "out_hidden_size": 4 * 32,
        "projector_hidden_size": hidden, "eos_token_id": [SPECIAL_TOKENS.index("<|im_end|>")],
        "mlxkv_tiny_model": {"family": "muse_glimmer", "hidden_size": hidden, "num_layers": layers, "seed": seed},
    }


NEMOTRON_OMNI_VISION_TOKENS = ["<image>", "<img>", "</img>", "<video>", "<so_embedding>"]


def nemotron_h_nano_omni_config(vocab_size: int, ids: dict[str, int], hidden: int = 64, layers: int = 4,
                                seed: int = 0, **_) -> dict:
    """Nemotron Nano Omni: a RADIO tower over 16-pixel patches, pixel-shuffled 2 x 2 as InternVL's, `<image>`
    x tokens between `<img>` and `</img>`; a Nemotron-H language model (Mamba 2, MLP and attention layers)."""
    text = {"model_type": "nemotron_h", "vocab_size": vocab_size, "hidden_size": hidden,
            "intermediate_size": 2 * hidden, "num_hidden_layers": 4, "hybrid_override_pattern": "M-*-",
            "max_position_embeddings": 4096, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": hidden // 4, "attention_bias": False, "mamba_num_heads": 4, "mamba_head_dim": hidden // 4,
            "mamba_proj_bias": False, "ssm_state_size": 16, "conv_kernel": 4, "n_groups": 1, "mlp_bias": False,
            "layer_norm_epsilon": 1e-5, "use_bias": False, "use_conv_bias": True}
    return {
        "model_type": "nemotron_h_nano_omni", "architectures": ["NemotronH_Nano_Omni_Reasoning_V3"],
        "text_config": text,
        "vision_config": {"model_type": "radio", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                          "intermediate_size": 64, "patch_size": 16, "image_size": 64, "max_resolution": 256,
                          "args": {"cpe_max_size": 256, "teachers": [], "register_multiple": None},
                          "min_num_patches": 16, "max_num_patches": 64},
        "vit_hidden_size": 32, "projector_hidden_size": hidden, "downsample_ratio": 0.5,
        "img_context_token_id": ids["<image>"], "video_context_token_id": ids["<video>"],
        "sound_context_token_id": ids["<so_embedding>"], "eos_token_id": [SPECIAL_TOKENS.index("<|im_end|>")],
        "mlxkv_tiny_model": {"family": "nemotron_h_nano_omni", "hidden_size": hidden, "num_layers": 4, "seed": seed},
    }


def mimo_v2_config(vocab_size: int, ids: dict[str, int], hidden: int = 64, layers: int = 2, seed: int = 0,
                   **_) -> dict:
    """MiMo-V2: Qwen2.5-VL's processor and placeholders, its own windowed tower, a sliding layer and a full
    one (attention sinks on the sliding one), dense feed-forward; an audio tower beside (no audio sent)."""
    base = qwen2_vl_config(vocab_size, ids, hidden, layers, seed)
    text = {"vocab_size": vocab_size, "hidden_size": hidden, "intermediate_size": 2 * hidden,
            "moe_intermediate_size": hidden, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "v_head_dim": 16, "swa_head_dim": 16, "swa_v_head_dim": 16,
            "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "partial_rotary_factor": 0.5,
            "max_position_embeddings": 4096, "sliding_window_size": 16, "hybrid_layer_pattern": [1, 0],
            "moe_layer_freq": [0, 0], "n_routed_experts": 4, "num_experts_per_tok": 2}
    return {
        **{k: base[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                "vision_end_token_id")},
        "model_type": "mimo_v2", "architectures": ["MiMoV2ForCausalLM"], "text_config": text,
        "vocab_size": vocab_size, "eos_token_id": SPECIAL_TOKENS.index("<|im_end|>"),
        "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "out_hidden_size": hidden,
                          "num_heads": 2, "num_key_value_heads": 2, "num_query_groups": 1, "qk_channels": 16,
                          "patch_size": 14, "spatial_patch_size": 14, "window_size": 56,
                          "visual_token_window_size": 16, "fullatt_block_indexes": [1]},
        "audio_config": {"out_hidden_size": hidden, "input_local_attn_heads": 2, "input_local_dim": 32,
                         "input_local_head_dim": 16, "input_local_intermediate_size": 64, "input_local_layers": 1},
        "mlxkv_tiny_model": {"family": "mimo_v2", "hidden_size": hidden, "num_layers": layers, "seed": seed},
    }


def glm_ocr_config(vocab_size: int, ids: dict[str, int], hidden: int = 64, layers: int = 2, seed: int = 0,
                   **_) -> dict:
    """GLM-OCR: GLM-4V's tower, placeholders and M-RoPE (over whole heads) before a small GLM."""
    config = glm4v_config(vocab_size, ids, hidden, layers, seed)
    text = config["text_config"]
    config["text_config"] = {
        "model_type": "glm_ocr_text", "vocab_size": vocab_size, "hidden_size": hidden,
        "intermediate_size": text["intermediate_size"], "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "num_hidden_layers": layers, "max_position_embeddings": 4096, "pad_token_id": 0,
        "eos_token_id": config["eos_token_id"], "num_nextn_predict_layers": 0, "dtype": "float32",
        "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "partial_rotary_factor": 1.0,
                            "rope_theta": 10000.0}}
    config["vision_config"].update(model_type="glm_ocr_vision", num_heads=2)
    config.update(image_start_token_id=ids["<|begin_of_image|>"], image_end_token_id=ids["<|end_of_image|>"])
    return _as_family(config, "glm_ocr", "GlmOcrForConditionalGeneration")


GLM4V_TEMPLATE = QWEN_VL_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>",
                                          "<|begin_of_image|><|image|><|end_of_image|>")
GLM4V_PREPROCESSOR = {
    "image_processor_type": "Glm4vImageProcessor", "processor_class": "Glm46VProcessor",
    "size": {"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 64}, "patch_size": 14, "merge_size": 2,
    "temporal_patch_size": 2, "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
    "do_normalize": True, "do_convert_rgb": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}
INTERNVL_VISION_TOKENS = ["<img>", "</img>", "<IMG_CONTEXT>"]
INTERNVL_TILE = 56  # pixels a tile's side: (56 / 14)^2 patches, pixel-shuffled by 2 x 2 into 4 tokens


def internvl_chat_config(vocab_size: int, ids: dict[str, int], hidden: int = 64, layers: int = 2, seed: int = 0,
                         **_) -> dict:
    """InternVL: an InternViT tower; an image is at most two tiles and a thumbnail, each tile's patches
    pixel-shuffled into 4 `<IMG_CONTEXT>` tokens, one run an image between `<img>` and `</img>`; a Qwen2."""
    text = {"model_type": "qwen2", "hidden_size": hidden, "num_hidden_layers": layers,
            "intermediate_size": 2 * hidden, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-6, "vocab_size": vocab_size, "rope_theta": 10000.0, "max_position_embeddings": 4096}
    return {
        "model_type": "internvl_chat", "architectures": ["InternVLChatModel"], "text_config": text,
        "vision_config": {"model_type": "intern_vit_6b", "num_hidden_layers": 1, "hidden_size": 32,
                          "intermediate_size": 64, "num_attention_heads": 2, "patch_size": 14,
                          "image_size": INTERNVL_TILE},
        "image_token_index": ids["<IMG_CONTEXT>"], "downsample_ratio": 0.5, "force_image_size": INTERNVL_TILE,
        "max_dynamic_patch": 2, "min_dynamic_patch": 1, "use_thumbnail": True,
        "vocab_size": vocab_size, "eos_token_id": [SPECIAL_TOKENS.index("<|im_end|>")],
        "mlxkv_tiny_model": {"family": "internvl_chat", "hidden_size": hidden, "num_layers": layers, "seed": seed},
    }


def internvl_config(vocab_size: int, ids: dict[str, int], hidden: int = 64, layers: int = 2, seed: int = 0,
                    **_) -> dict:
    """InternVL 3 in transformers' layout: InternVL's tiles and tokens (internvl_chat_config), its own
    vision tower, a Qwen3."""
    config = internvl_chat_config(vocab_size, ids, hidden, layers, seed)
    config["text_config"].update(model_type="qwen3", head_dim=16, tie_word_embeddings=False)
    config["vision_config"]["model_type"] = "internvl_vision"
    config["image_token_id"] = config.pop("image_token_index")
    return _as_family(config, "internvl", "InternVLForConditionalGeneration")


INTERNVL_TEMPLATE = QWEN_VL_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<image>")
AYA_VISION_TOKENS = ["<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>", "TILE",
                     "TILE_GLOBAL"]
AYA_TILE = 56  # pixels a tile's side: (56 / 14)^2 patches, pixel-shuffled by 2 x 2 into 4 tokens


def aya_vision_config(vocab_size: int, ids: dict[str, int], hidden: int = 64, layers: int = 2, seed: int = 0,
                      **_) -> dict:
    """Aya Vision: a SigLIP tower; an image is up to two tiles `TILE_i` and a global view after
    `TILE_GLOBAL`, each 4 `<|IMG_PATCH|>` tokens, between `<|START_OF_IMG|>` and `<|END_OF_IMG|>`;
    a Cohere 2 with a sliding layer then a full one."""
    text = {"model_type": "cohere2", "hidden_size": hidden, "head_dim": 16, "num_hidden_layers": layers,
            "intermediate_size": 2 * hidden, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": vocab_size, "rope_theta": 10000.0, "sliding_window": 16, "sliding_window_pattern": 2,
            "logit_scale": 0.25, "max_position_embeddings": 4096}
    return {
        "model_type": "aya_vision", "architectures": ["AyaVisionForConditionalGeneration"], "text_config": text,
        "vision_config": {"model_type": "siglip_vision_model", "num_hidden_layers": 1, "hidden_size": 32,
                          "intermediate_size": 64, "num_attention_heads": 2, "patch_size": 14,
                          "image_size": AYA_TILE},
        "image_token_index": ids["<|IMG_PATCH|>"], "downsample_factor": 2, "alignment_intermediate_size": 2 * hidden,
        "vision_feature_layer": -1, "vision_feature_select_strategy": "full", "vocab_size": vocab_size,
        "eos_token_id": [SPECIAL_TOKENS.index("<|im_end|>")],
        "mlxkv_tiny_model": {"family": "aya_vision", "hidden_size": hidden, "num_layers": layers, "seed": seed},
    }


AYA_PREPROCESSOR = {
    "image_processor_type": "GotOcr2ImageProcessor", "processor_class": "AyaVisionProcessor",
    "crop_to_patches": True, "min_patches": 1, "max_patches": 2, "size": {"height": AYA_TILE, "width": AYA_TILE},
    "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
}
LLAVA_VISION_TOKENS = ["<image>", "<video>"]
LLAVA_TILE = 28  # pixels a tile's side: (28 / 14)^2 = 4 patches, a placeholder each
LLAVA_PINPOINTS = [[LLAVA_TILE, LLAVA_TILE], [LLAVA_TILE, 2 * LLAVA_TILE], [2 * LLAVA_TILE, LLAVA_TILE],
                   [2 * LLAVA_TILE, 2 * LLAVA_TILE]]


def llava_onevision_config(vocab_size: int, ids: dict[str, int], hidden: int = 64, layers: int = 2, seed: int = 0,
                           **_) -> dict:
    """LLaVA-OneVision: a SigLIP tower over AnyRes tiles (the base view, then the tiles of the best
    pinpoint, unpadded, a newline a row), one run of `<image>` an image; a Qwen2."""
    text = {"model_type": "qwen2", "hidden_size": hidden, "num_hidden_layers": layers,
            "intermediate_size": 2 * hidden, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-6, "vocab_size": vocab_size, "rope_theta": 10000.0, "max_position_embeddings": 4096}
    return {
        "model_type": "llava_onevision", "architectures": ["LlavaOnevisionForConditionalGeneration"],
        "text_config": text,
        "vision_config": {"model_type": "siglip_vision_model", "num_hidden_layers": 1, "hidden_size": 32,
                          "intermediate_size": 64, "num_attention_heads": 2, "patch_size": 14,
                          "image_size": LLAVA_TILE},
        "image_token_index": ids["<image>"], "video_token_index": ids["<video>"],
        "image_grid_pinpoints": LLAVA_PINPOINTS, "vision_aspect_ratio": "anyres_max_4",
        "vision_feature_select_strategy": "full", "vision_feature_layer": -1, "vocab_size": vocab_size,
        "eos_token_id": [SPECIAL_TOKENS.index("<|im_end|>")],
        "mlxkv_tiny_model": {"family": "llava_onevision", "hidden_size": hidden, "num_layers": layers, "seed": seed},
    }


LLAVA_ONEVISION_PREPROCESSOR = {
    "image_processor_type": "LlavaOnevisionImageProcessor", "processor_class": "LlavaOnevisionProcessor",
    "size": {"height": LLAVA_TILE, "width": LLAVA_TILE}, "image_grid_pinpoints": LLAVA_PINPOINTS,
    "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_pad": True,
    "do_convert_rgb": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 3,
}
# family -> (vision tokens, config, template, preprocessor, processor class, tokenizer extras)
FAMILIES = {
    "qwen2_vl": (QWEN_VISION_TOKENS, qwen2_vl_config, QWEN_VL_TEMPLATE, PREPROCESSOR, "Qwen2VLProcessor", {}),
    "qwen2_5_vl": (QWEN_VISION_TOKENS, qwen2_5_vl_config, QWEN_VL_TEMPLATE, {**PREPROCESSOR,
                   "processor_class": "Qwen2_5_VLProcessor"}, "Qwen2_5_VLProcessor", {}),
    "qwen3_vl": (QWEN_VISION_TOKENS, qwen3_vl_config, QWEN_VL_TEMPLATE, QWEN3_VL_PREPROCESSOR, "Qwen3VLProcessor",
                 {}),
    "mistral3": (MISTRAL3_VISION_TOKENS, mistral3_config, MISTRAL3_TEMPLATE, MISTRAL3_PREPROCESSOR,
                 "Mistral3Processor", {}),
    "pixtral": (MISTRAL3_VISION_TOKENS, pixtral_config, MISTRAL3_TEMPLATE,
                {**MISTRAL3_PREPROCESSOR, "size": {"longest_edge": 56}, "processor_class": "PixtralProcessor"},
                "PixtralProcessor", {}),
    "mage_vl": (QWEN_VISION_TOKENS, mage_vl_config, QWEN_VL_TEMPLATE,
                {**QWEN3_VL_PREPROCESSOR, "temporal_patch_size": 1, "merge_size": 2, "processor_class": "MageVLProcessor"},
                "MageVLProcessor", {}),
    "cohere_compass": (COHERE_COMPASS_VISION_TOKENS, cohere_compass_config,
                       QWEN_VL_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>",
                                                "<|VISION_START|><|IMAGE_PAD|><|VISION_END|>"),
                       {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2, "min_pixels": 32 * 32 * 4,
                        "max_pixels": 32 * 32 * 64, "processor_class": "CohereCompassProcessor"},
                       "CohereCompassProcessor", {"extra_special_tokens": {"image_token": "<|IMAGE_PAD|>"}}),
    "muse_glimmer": (MUSE_GLIMMER_VISION_TOKENS, muse_glimmer_config,
                     QWEN_VL_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<|patch|>"),
                     {}, "MuseGlimmerProcessor", {}),
    "nemotron_h_nano_omni": (NEMOTRON_OMNI_VISION_TOKENS, nemotron_h_nano_omni_config,
                             QWEN_VL_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<image>"),
                             {"norm_mean": [0.5] * 3, "norm_std": [0.5] * 3, "patch_size": 16,
                              "downsample_ratio": 0.5, "min_num_patches": 16, "max_num_patches": 64},
                             "NemotronHNanoOmniProcessor", {}),
    "mimo_v2": (QWEN_VISION_TOKENS + ["<|audio_pad|>"], mimo_v2_config, QWEN_VL_TEMPLATE,
                {**PREPROCESSOR, "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "MiMoV2Processor"},
                "MiMoV2Processor", {}),
    "qwen3_vl_moe": (QWEN_VISION_TOKENS, qwen3_vl_moe_config, QWEN_VL_TEMPLATE,
                     {**QWEN3_VL_PREPROCESSOR, "processor_class": "Qwen3VLProcessor"}, "Qwen3VLProcessor", {}),
    "glm4v": (GLM4V_VISION_TOKENS, glm4v_config, GLM4V_TEMPLATE, GLM4V_PREPROCESSOR, "Glm46VProcessor",
              {"extra_special_tokens": {"image_token": "<|image|>"}}),
    "glm4v_moe": (GLM4V_VISION_TOKENS, glm4v_moe_config, GLM4V_TEMPLATE, GLM4V_PREPROCESSOR, "Glm46VProcessor",
                  {"extra_special_tokens": {"image_token": "<|image|>"}}),
    "idefics2": (SMOLVLM_VISION_TOKENS, idefics2_config, SMOLVLM_TEMPLATE,
                 {**SMOLVLM_PREPROCESSOR, "image_processor_type": "Idefics2ImageProcessor",
                  "processor_class": "Idefics2Processor", "do_image_splitting": False,
                  "size": {"shortest_edge": SMOLVLM_TILE, "longest_edge": SMOLVLM_TILE}},
                 "Idefics2Processor", {}),
    "gemma3": (GEMMA3_VISION_TOKENS, gemma3_config, GEMMA3_TEMPLATE, GEMMA3_PREPROCESSOR, "Gemma3Processor",
               {"extra_special_tokens": {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>",
                                         "eoi_token": "<end_of_image>"}}),
    "smolvlm": (SMOLVLM_VISION_TOKENS, smolvlm_config, SMOLVLM_TEMPLATE, SMOLVLM_PREPROCESSOR, "SmolVLMProcessor",
                {"extra_special_tokens": {"image_token": "<image>", "fake_image_token": "<fake_token_around_image>",
                                          "global_image_token": "<global-img>",
                                          "end_of_utterance_token": "<end_of_utterance>"}}),
    "idefics3": (SMOLVLM_VISION_TOKENS, idefics3_config, SMOLVLM_TEMPLATE, IDEFICS3_PREPROCESSOR, "Idefics3Processor",
                 {}),
    "internvl_chat": (INTERNVL_VISION_TOKENS, internvl_chat_config, INTERNVL_TEMPLATE, {},
                      "InternVLChatProcessor", {}),
    "aya_vision": (AYA_VISION_TOKENS, aya_vision_config, INTERNVL_TEMPLATE, AYA_PREPROCESSOR, "AyaVisionProcessor",
                   {}),
    "llava_onevision": (LLAVA_VISION_TOKENS, llava_onevision_config, INTERNVL_TEMPLATE, LLAVA_ONEVISION_PREPROCESSOR,
                        "LlavaOnevisionProcessor", {}),
    "kimi_vl": (KIMI_VL_VISION_TOKENS, kimi_vl_config, KIMI_VL_TEMPLATE, KIMI_VL_PREPROCESSOR, "KimiVLProcessor", {}),
    "internvl": (INTERNVL_VISION_TOKENS, internvl_config, INTERNVL_TEMPLATE, {}, "InternVLProcessor", {}),
    "kimi_k3": (KIMI_K3_VISION_TOKENS, kimi_k3_config, KIMI_VL_TEMPLATE.replace("media_start", "media_begin"),
                {"media_proc_cfg": {"patch_size": 14, "merge_kernel_size": [2, 2], "in_patch_limit": 256}},
                "KimiK3Processor", {}),
    "kimi_k25": (KIMI_VL_VISION_TOKENS, kimi_k25_config, KIMI_VL_TEMPLATE,
                 {**KIMI_VL_PREPROCESSOR, "image_processor_type": "KimiK25ImageProcessor",
                  "processor_class": "KimiK25Processor"}, "KimiK25Processor", {}),
    "minimax_m3_vl": (MINIMAX_M3_VL_VISION_TOKENS, minimax_m3_vl_config,
                      QWEN_VL_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "]<]image[>["),
                      {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2, "max_pixels": 112 * 112 * 4},
                      "MiniMaxM3VLProcessor", {}),
    "glm_ocr": (GLM4V_VISION_TOKENS, glm_ocr_config, GLM4V_TEMPLATE,
                {**GLM4V_PREPROCESSOR, "processor_class": "GlmOcrProcessor"}, "GlmOcrProcessor",
                {"extra_special_tokens": {"image_token": "<|image|>"}}),
}
# family -> its processor_config.json (the processor's own settings: placeholder counts, tokens)
PROCESSOR_CONFIGS = {
    "muse_glimmer": {"patch_size": 14, "merge_size": 2, "max_image_tokens": 16, "processor_class": "MuseGlimmerProcessor"},
    "aya_vision": {"img_size": AYA_TILE, "patch_size": 14, "downsample_factor": 2,
                   "processor_class": "AyaVisionProcessor"},
    "internvl": {"image_seq_length": (INTERNVL_TILE // 14 // 2) ** 2, "processor_class": "InternVLProcessor"},
    "llava_onevision": {"num_image_tokens": (LLAVA_TILE // 14) ** 2, "vision_feature_select_strategy": "full",
                        "image_token": "<image>", "processor_class": "LlavaOnevisionProcessor"},
}

# LLaVA 1.5 and the families whose merge inserts an image's features: tiny_llava.py
from mlxkv.vision.tiny_llava import LLAVA_FAMILIES, LLAVA_PROCESSOR_CONFIGS  # noqa: E402

FAMILIES.update(LLAVA_FAMILIES)
PROCESSOR_CONFIGS.update(LLAVA_PROCESSOR_CONFIGS)

# Families whose processors take the image token in string content: tiny_token_families.py
from mlxkv.vision import tiny_token_families  # noqa: E402

FAMILIES.update(tiny_token_families.FAMILIES)
PROCESSOR_CONFIGS.update(tiny_token_families.PROCESSOR_CONFIGS)
