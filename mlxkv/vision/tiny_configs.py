"""The tiny vision models' configs, one function a family, and their processors' files.

Each family's entry in FAMILIES: its vision tokens, a config from mlx-vlm's
fields (shapes cut to what a CPU test runs in a second), a chat template cut
to text and image parts, its preprocessor_config.json, its processor class
and tokenizer extras. tiny_vlm.py writes them.
"""

from __future__ import annotations

from mlxkv.models.tiny import SPECIAL_TOKENS

QWEN_VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen2-VL's template, cut to what the tests send: text and image parts.
QWEN_VL_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _as_family(config: dict, family: str, architecture: str) -> dict:
    """`config` renamed as another family that shares its classes' fields (its tiny-model record too)."""
    config.update(model_type=family, architectures=[architecture])
    config["mlxkv_tiny_model"]["family"] = family
    return config


def qwen2_vl_config(vocab_size: int, ids: dict[str, int], hidden: int = 64, layers: int = 2, seed: int = 0,
                    vision_depth: int = 1, vision_dim: int = 32) -> dict:
    heads, kv_heads = 4, 2
    half = hidden // heads // 2  # M-RoPE splits each head's rotary half into (t, h, w)
    section = [half - 2 * (half // 3), half // 3, half // 3]
    return {
        "model_type": "qwen2_vl",
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": 3 * hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": section},
        "tie_word_embeddings": False,
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "bos_token_id": SPECIAL_TOKENS.index("<|endoftext|>"),
        "eos_token_id": [SPECIAL_TOKENS.index("<|im_end|>")],  # one eos: replies of random weights run longer
        "torch_dtype": "float32",
        "vision_config": {
            "model_type": "qwen2_vl", "depth": vision_depth, "embed_dim": vision_dim, "hidden_size": hidden,
            "num_heads": 2,
            "mlp_ratio": 2, "patch_size": 14, "spatial_patch_size": 14, "spatial_merge_size": 2,
            "temporal_patch_size": 2, "in_channels": 3,
        },
        "mlxkv_tiny_model": {"family": "qwen2_vl", "hidden_size": hidden, "num_layers": layers, "seed": seed},
    }


PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
    "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
    "rescale_factor": 1 / 255,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    # Small images stay small: 28x28 pixels per placeholder token.
    "min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 64,
    "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2,
}


def qwen2_5_vl_config(vocab_size: int, ids: dict[str, int], hidden: int = 64, layers: int = 2, seed: int = 0,
                      **_) -> dict:
    """Qwen2-VL's language model; a vision tower with window attention (one windowed block, one full)."""
    config = qwen2_vl_config(vocab_size, ids, hidden, layers, seed)
    config.update(model_type="qwen2_5_vl", architectures=["Qwen2_5_VLForConditionalGeneration"])
    config["vision_config"] = {
        "model_type": "qwen2_5_vl", "depth": 2, "hidden_size": 32, "intermediate_size": 64,
        "out_hidden_size": hidden, "num_heads": 2, "patch_size": 14, "spatial_patch_size": 14,
        "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56, "fullatt_block_indexes": [1],
        "in_channels": 3, "tokens_per_second": 2,
    }
    config["mlxkv_tiny_model"]["family"] = "qwen2_5_vl"
    return config


def qwen3_vl_config(vocab_size: int, ids: dict[str, int], hidden: int = 64, layers: int = 2, seed: int = 0,
                    **_) -> dict:
    """Qwen3-VL: M-RoPE as Qwen2-VL, 16-pixel patches, and deepstack: the vision tower's middle
    layers' output is added to the language model's first layers' hidden states at image tokens."""
    base = qwen2_vl_config(vocab_size, ids, hidden, layers, seed)
    head_dim = hidden // 4
    half = head_dim // 2
    section = [half - 2 * (half // 3), half // 3, half // 3]
    text = {"model_type": "qwen3_vl_text", "hidden_size": hidden, "num_hidden_layers": layers,
            "intermediate_size": 3 * hidden, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": head_dim, "rms_norm_eps": 1e-6, "vocab_size": vocab_size, "rope_theta": 10000.0,
            "max_position_embeddings": 4096, "tie_word_embeddings": False,
            "rope_scaling": {"rope_type": "default", "mrope_section": section, "mrope_interleaved": True}}
    return {
        **{k: base[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                "vision_end_token_id", "bos_token_id", "eos_token_id")},
        "model_type": "qwen3_vl", "architectures": ["Qwen3VLForConditionalGeneration"], "text_config": text,
        "vocab_size": vocab_size, "tie_word_embeddings": False,
        "vision_config": {"model_type": "qwen3_vl", "depth": 2, "hidden_size": 32, "intermediate_size": 64,
                          "out_hidden_size": hidden, "num_heads": 2, "patch_size": 16, "spatial_merge_size": 2,
                          "temporal_patch_size": 2, "in_channels": 3, "num_position_embeddings": 64,
                          "deepstack_visual_indexes": [0]},
        "mlxkv_tiny_model": {"family": "qwen3_vl", "hidden_size": hidden, "num_layers": layers, "seed": seed},
    }


COHERE_COMPASS_VISION_TOKENS = ["<|VISION_START|>", "<|VISION_END|>", "<|IMAGE_PAD|>"]


def cohere_compass_config(vocab_size: int, ids: dict[str, int], hidden: int = 64, layers: int = 2, seed: int = 0,
                          **_) -> dict:
    """Cohere Compass: Qwen3-VL's shape (16-pixel patches merged 2 x 2, interleaved M-RoPE, deepstack)
    over a Command-style decoder (layer norm, parallel attention and MLP)."""
    head_dim = hidden // 4
    half = head_dim // 2
    section = [half - 2 * (half // 3), half // 3, half // 3]
    text = {"model_type": "cohere_compass_text", "hidden_size": hidden, "num_hidden_layers": layers,
            "intermediate_size": 2 * hidden, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": head_dim, "vocab_size": vocab_size, "max_position_embeddings": 4096,
            "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                                 "mrope_section": section}}}
    return {
        "model_type": "cohere_compass", "architectures": ["CohereCompassForConditionalGeneration"],
        "text_config": text, "vocab_size": vocab_size,
        "vision_config": {"model_type": "cohere_compass_vision", "depth": 2, "hidden_size": 32,
                          "intermediate_size": 64, "num_heads": 2, "patch_size": 16, "spatial_merge_size": 2,
                          "temporal_patch_size": 2, "out_hidden_size": hidden, "num_position_embeddings": 64,
                          "deepstack_visual_indexes": [0]},
        "image_token_id": ids["<|IMAGE_PAD|>"], "vision_start_token_id": ids["<|VISION_START|>"],
        "vision_end_token_id": ids["<|VISION_END|>"], "min_pixels": 32 * 32 * 4, "max_pixels": 32 * 32 * 64,
        "eos_token_id": [SPECIAL_TOKENS.index("<|im_end|>")],
        "mlxkv_tiny_model": {"family": "cohere_compass", "hidden_size": hidden, "num_layers": layers, "seed": seed},
    }


def qwen3_vl_moe_config(vocab_size: int, ids: dict[str, int], hidden: int = 64, layers: int = 2, seed: int = 0,
                        **_) -> dict:
    """Qwen3-VL's tower, positions and deepstack before a mixture-of-experts language model."""
    config = qwen3_vl_config(vocab_size, ids, hidden, layers, seed)
    config["text_config"].update(model_type="qwen3_vl_moe_text", num_experts=4, num_experts_per_tok=2,
                                 decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=hidden)
    config.update(model_type="qwen3_vl_moe", architectures=["Qwen3VLMoeForConditionalGeneration"])
    config["vision_config"]["model_type"] = "qwen3_vl_moe"
    config["mlxkv_tiny_model"]["family"] = "qwen3_vl_moe"
    return config


QWEN3_VL_PREPROCESSOR = {**PREPROCESSOR, "image_processor_type": "Qwen3VLImageProcessor",
                         "processor_class": "Qwen3VLProcessor", "patch_size": 16,
                         # Small images stay small: 32x32 pixels per placeholder token.
                         "min_pixels": 32 * 32 * 4, "max_pixels": 32 * 32 * 64,
                         "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


GEMMA3_VISION_TOKENS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
GEMMA3_IMAGE_TOKENS = 16  # mm_tokens_per_image: a fixed count per image (256 in real Gemma 3)
GEMMA3_IMAGE_SIZE = 112


def gemma3_config(vocab_size: int, ids: dict[str, int], hidden: int = 64, layers: int = 2, seed: int = 0,
                  **_) -> dict:
    text = {"model_type": "gemma3_text", "hidden_size": hidden, "num_hidden_layers": layers,
            "intermediate_size": 2 * hidden, "num_attention_heads": 4, "head_dim": 16, "num_key_value_heads": 2,
            "vocab_size": vocab_size, "query_pre_attn_scalar": 16, "max_position_embeddings": 4096,
            # A sliding layer then a full one: the pool pages both kinds.
            "sliding_window": 16, "sliding_window_pattern": 2, "mm_tokens_per_image": GEMMA3_IMAGE_TOKENS}
    return {
        "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "text_config": text,
        "vision_config": {"model_type": "siglip_vision_model", "num_hidden_layers": 1, "hidden_size": 32,
                          "intermediate_size": 64, "num_attention_heads": 2, "patch_size": 14,
                          "image_size": GEMMA3_IMAGE_SIZE},
        "image_token_index": ids["<image_soft_token>"], "boi_token_index": ids["<start_of_image>"],
        "eoi_token_index": ids["<end_of_image>"], "mm_tokens_per_image": GEMMA3_IMAGE_TOKENS,
        "hidden_size": hidden, "pad_token_id": 0, "vocab_size": vocab_size,
        "eos_token_id": [SPECIAL_TOKENS.index("<|im_end|>")],
        "mlxkv_tiny_model": {"family": "gemma3", "hidden_size": hidden, "num_layers": layers, "seed": seed},
    }


GEMMA3_TEMPLATE = QWEN_VL_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<start_of_image>")
GEMMA3_PREPROCESSOR = {
    "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
    "do_resize": True, "size": {"height": GEMMA3_IMAGE_SIZE, "width": GEMMA3_IMAGE_SIZE},
    "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_pan_and_scan": False,
    "image_seq_length": GEMMA3_IMAGE_TOKENS,
}
SMOLVLM_TILE_TOKENS = 4  # image_seq_len: (56 / 14)^2 patches a tile, pixel-shuffled by 2 x 2
SMOLVLM_TILE = 56  # pixels a tile's side (max_image_size); an image is resized to at most 112 first
SMOLVLM_VISION_TOKENS = (["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"]
                         + [f"<row_{r}_col_{c}>" for r in range(1, 5) for c in range(1, 5)])


def smolvlm_config(vocab_size: int, ids: dict[str, int], hidden: int = 64, layers: int = 2, seed: int = 0,
                   **_) -> dict:
    """SmolVLM: Idefics3's model class; an image is cut into tiles plus a global view, each tile's
    SigLIP output pixel-shuffled into SMOLVLM_TILE_TOKENS placeholder tokens."""
    text = {"model_type": "llama", "hidden_size": hidden, "num_hidden_layers": layers,
            "intermediate_size": 2 * hidden, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5, "vocab_size": vocab_size, "rope_theta": 10000.0,
            "max_position_embeddings": 4096}
    return {
        "model_type": "smolvlm", "architectures": ["SmolVLMForConditionalGeneration"], "text_config": text,
        "vision_config": {"model_type": "smolvlm_vision", "num_hidden_layers": 1, "hidden_size": 32,
                          "intermediate_size": 64, "num_attention_heads": 2, "patch_size": 14,
                          "image_size": SMOLVLM_TILE},
        "scale_factor": 2, "image_token_id": ids["<image>"], "vocab_size": vocab_size, "pad_token_id": 0,
        "eos_token_id": [SPECIAL_TOKENS.index("<|im_end|>")],
        "mlxkv_tiny_model": {"family": "smolvlm", "hidden_size": hidden, "num_layers": layers, "seed": seed},
    }


def idefics3_config(vocab_size: int, ids: dict[str, int], hidden: int = 64, layers: int = 2, seed: int = 0,
                    **_) -> dict:
    """Idefics3: SmolVLM's model class and tiling, its own processor (mlx-vlm's Idefics3Processor)."""
    config = _as_family(smolvlm_config(vocab_size, ids, hidden, layers, seed), "idefics3",
                        "Idefics3ForConditionalGeneration")
    config["vision_config"]["model_type"] = "idefics3_vision"
    return config


IDEFICS2_IMAGE_TOKENS = 8  # the perceiver's latents: a fixed count an image (64 in real checkpoints)


def idefics2_config(vocab_size: int, ids: dict[str, int], hidden: int = 64, layers: int = 2, seed: int = 0,
                    **_) -> dict:
    """Idefics2: SigLIP patches resampled by a perceiver to a fixed count of `<image>` tokens between
    `<fake_token_around_image>`s (images not split: one run an image), a Mistral."""
    config = smolvlm_config(vocab_size, ids, hidden, layers, seed)
    config["text_config"]["model_type"] = "mistral"
    config.update(model_type="idefics2", architectures=["Idefics2ForConditionalGeneration"])
    config["vision_config"]["model_type"] = "idefics2"
    config["perceiver_config"] = {"model_type": "idefics2", "num_key_value_heads": 2, "resampler_depth": 1,
                                  "resampler_head_dim": 16, "resampler_n_heads": 2,
                                  "resampler_n_latents": IDEFICS2_IMAGE_TOKENS}
    config["mlxkv_tiny_model"]["family"] = "idefics2"
    return config


SMOLVLM_TEMPLATE = QWEN_VL_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<image>")
SMOLVLM_PREPROCESSOR = {
    "image_processor_type": "SmolVLMImageProcessor", "processor_class": "SmolVLMProcessor",
    "do_convert_rgb": True, "do_image_splitting": True, "do_normalize": True, "do_pad": True,
    "do_rescale": True, "do_resize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "max_image_size": {"longest_edge": SMOLVLM_TILE}, "resample": 1, "rescale_factor": 1 / 255,
    "size": {"longest_edge": 2 * SMOLVLM_TILE},
}
IDEFICS3_PREPROCESSOR = {**SMOLVLM_PREPROCESSOR, "image_processor_type": "Idefics3ImageProcessor",
                         "processor_class": "Idefics3Processor"}
MISTRAL3_VISION_TOKENS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]
MISTRAL3_IMAGE_SIZE = 112  # longest edge; a placeholder per 28x28 pixels (14-pixel patches merged 2 x 2)


def mistral3_config(vocab_size: int, ids: dict[str, int], hidden: int = 64, layers: int = 2, seed: int = 0,
                    **_) -> dict:
    """Mistral 3 (Mistral Small 3.x): a Pixtral tower with RoPE-2D, its patches merged 2 x 2; an image is
    rows of `[IMG]` placeholders, each row ended by `[IMG_BREAK]`, the last by `[IMG_END]`; a Mistral."""
    text = {"model_type": "mistral", "hidden_size": hidden, "num_hidden_layers": layers,
            "intermediate_size": 2 * hidden, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "rms_norm_eps": 1e-5, "vocab_size": vocab_size, "rope_theta": 10000.0, "max_position_embeddings": 4096}
    return {
        "model_type": "mistral3", "architectures": ["Mistral3ForConditionalGeneration"], "text_config": text,
        "vision_config": {"model_type": "pixtral", "num_hidden_layers": 1, "hidden_size": 32, "head_dim": 16,
                          "intermediate_size": 64, "num_attention_heads": 2, "patch_size": 14,
                          "image_size": MISTRAL3_IMAGE_SIZE},
        "image_token_index": ids["[IMG]"], "spatial_merge_size": 2, "vision_feature_layer": -1,
        "multimodal_projector_bias": False, "vocab_size": vocab_size, "pad_token_id": 0,
        "eos_token_id": [SPECIAL_TOKENS.index("<|im_end|>")],
        "mlxkv_tiny_model": {"family": "mistral3", "hidden_size": hidden, "num_layers": layers, "seed": seed},
    }


def pixtral_config(vocab_size: int, ids: dict[str, int], hidden: int = 64, layers: int = 2, seed: int = 0,
                   **_) -> dict:
    """Pixtral: Mistral 3's tower and placeholder rows, a placeholder a patch (no merge)."""
    config = mistral3_config(vocab_size, ids, hidden, layers, seed)
    config.update(model_type="pixtral", architectures=["LlavaForConditionalGeneration"])
    del config["spatial_merge_size"]
    config["mlxkv_tiny_model"]["family"] = "pixtral"
    return config


MISTRAL3_TEMPLATE = QWEN_VL_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "[IMG]")
MISTRAL3_PREPROCESSOR = {
    "image_processor_type": "PixtralImageProcessor", "processor_class": "Mistral3Processor",
    "size": {"longest_edge": MISTRAL3_IMAGE_SIZE}, "patch_size": {"height": 14, "width": 14},
    "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
    "do_convert_rgb": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}
GLM4V_VISION_TOKENS = ["<|begin_of_image|>", "<|end_of_image|>", "<|image|>", "<|begin_of_video|>",
                       "<|end_of_video|>", "<|video|>"]


def glm4v_config(vocab_size: int, ids: dict[str, int], hidden: int = 64, layers: int = 2, seed: int = 0,
                 **_) -> dict:
    """GLM-4.1V/4.5V/4.6V: M-RoPE on half of each head, `<|image|>` x (h * w / 4 patches of 14 px)."""
    text = {"model_type": "glm4v_text", "hidden_size": hidden, "num_hidden_layers": layers,
            "intermediate_size": 2 * hidden, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5, "vocab_size": vocab_size, "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "max_position_embeddings": 4096, "pad_token_id": 0,
            "rope_scaling": {"rope_type": "default", "mrope_section": [2, 1, 1]}}
    return {
        "model_type": "glm4v", "architectures": ["Glm4vForConditionalGeneration"], "text_config": text,
        "vision_config": {"model_type": "glm4v", "depth": 1, "hidden_size": 32, "intermediate_size": 64,
                          "num_heads": 2, "patch_size": 14, "image_size": 112, "out_hidden_size": hidden,
                          "spatial_merge_size": 2, "temporal_patch_size": 2},
        "image_token_id": ids["<|image|>"], "image_token_index": ids["<|image|>"],
        "video_token_id": ids["<|video|>"], "video_token_index": ids["<|video|>"],
        "vision_start_token_id": ids["<|begin_of_image|>"], "vision_end_token_id": ids["<|end_of_image|>"],
        "hidden_size": hidden, "vocab_size": vocab_size, "pad_token_id": 0,
        "eos_token_id": [SPECIAL_TOKENS.index("<|im_end|>")],
        "mlxkv_tiny_model": {"family": "glm4v", "hidden_size": hidden, "num_layers": layers, "seed": seed},
    }


def glm4v_moe_config(vocab_size: int, ids: dict[str, int], hidden: int = 64, layers: int = 2, seed: int = 0,
                     **_) -> dict:
    """GLM-4.5V/4.6V's MoE: GLM-4V's tower and positions before routed and shared experts (first layer dense)."""
    config = glm4v_config(vocab_size, ids, hidden, layers, seed)
    config["text_config"].update(
        model_type="glm4v_moe_text", moe_intermediate_size=hidden, norm_topk_prob=True, n_group=1, topk_group=1,
        head_dim=16, n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=1.0, num_experts_per_tok=2,
        first_k_dense_replace=1, use_qk_norm=False, attention_bias=True)
    config.update(model_type="glm4v_moe", architectures=["Glm4vMoeForConditionalGeneration"])
    config["vision_config"]["model_type"] = "glm4v_moe"
    config["mlxkv_tiny_model"]["family"] = "glm4v_moe"
    return config
