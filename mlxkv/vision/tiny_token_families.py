"""The tiny vision models of the families whose processors take the image token in string content
(vision/rendering.py writes it there): their configs and processor files, appended to
tiny_families.py's table."""

from __future__ import annotations

from mlxkv.models.tiny import SPECIAL_TOKENS
from mlxkv.vision.tiny_configs import QWEN3_VL_PREPROCESSOR, QWEN_VL_TEMPLATE

# The template of a family whose content arrives as a string (image tokens already in it).
STRING_TEMPLATE = QWEN_VL_TEMPLATE
LLMJPVL_VISION_TOKENS = ["<image>", "<img>", "</img>", "<IMG_CONTEXT>"]
LLMJPVL_TILE = 64  # pixels a tile's side: (64 / 16)^2 SigLIP patches, pixel-shuffled by 2 x 2 into 4 tokens


def llmjpvl_config(vocab_size: int, ids: dict[str, int], hidden: int = 64, layers: int = 2, seed: int = 0,
                   **_) -> dict:
    """LLM-jp-VL: a SigLIP tower over 16 px patches, pixel-shuffled 2 x 2 as InternVL's, `<IMG_CONTEXT>` x
    tokens an image tile between `<img>` and `</img>`; a Llama."""
    text = {"model_type": "llama", "hidden_size": hidden, "num_hidden_layers": layers,
            "intermediate_size": 2 * hidden, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "rms_norm_eps": 1e-6, "vocab_size": vocab_size, "rope_theta": 10000.0, "max_position_embeddings": 4096}
    return {
        "model_type": "llmjpvl", "architectures": ["LlmJpVLForConditionalGeneration"], "text_config": text,
        "vision_config": {"model_type": "siglip_vision_model", "num_hidden_layers": 1, "hidden_size": 32,
                          "intermediate_size": 64, "num_attention_heads": 2, "patch_size": 16,
                          "image_size": LLMJPVL_TILE},
        "img_context_token_id": ids["<IMG_CONTEXT>"], "downsample_ratio": 0.5, "vocab_size": vocab_size,
        "eos_token_id": [SPECIAL_TOKENS.index("<|im_end|>")],
        "mlxkv_tiny_model": {"family": "llmjpvl", "hidden_size": hidden, "num_layers": layers, "seed": seed},
    }


# Its checkpoint's processor is its own remote code, and transformers' InternVLProcessor needs PyTorch: the tiny
# model takes Gemma 3's processor, which resizes to one tile and writes `<img>` + 4 `<IMG_CONTEXT>` + `</img>` for
# each `<image>` in the text, as LLM-jp-VL's expands it.
LLMJPVL_PREPROCESSOR = {
    "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor", "do_resize": True,
    "size": {"height": LLMJPVL_TILE, "width": LLMJPVL_TILE}, "do_rescale": True, "rescale_factor": 1 / 255,
    "do_normalize": True, "do_convert_rgb": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "do_pan_and_scan": False,
}
MINICPMO_VISION_TOKENS = ["<image>", "</image>", "<unk>", "<slice>", "</slice>", "<|listen|>"]
MINICPMO_QUERIES = 4  # the resampler's queries: `<unk>` x this an image (64 in real checkpoints)


def minicpmo_config(vocab_size: int, ids: dict[str, int], hidden: int = 64, layers: int = 2, seed: int = 0,
                    **_) -> dict:
    """MiniCPM-o: a SigLIP tower over 14 px patches, its output resampled to a fixed count of queries written
    over `<unk>` x count between `<image>` and `</image>`; Qwen3-VL's language model (M-RoPE over plain
    positions). No audio tower, no speech decoder."""
    head_dim = hidden // 4
    half = head_dim // 2
    text = {"model_type": "qwen3", "hidden_size": hidden, "num_hidden_layers": layers,
            "intermediate_size": 2 * hidden, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": head_dim, "rms_norm_eps": 1e-6, "vocab_size": vocab_size, "rope_theta": 10000.0,
            "max_position_embeddings": 4096,
            "rope_scaling": {"type": "default", "mrope_section": [half - 2 * (half // 3), half // 3, half // 3]}}
    return {
        "model_type": "minicpmo", "architectures": ["MiniCPMO"], "text_config": text,
        "vision_config": {"model_type": "siglip_vision_model", "num_hidden_layers": 1, "hidden_size": 32,
                          "intermediate_size": 64, "num_attention_heads": 2, "patch_size": 14, "image_size": 56},
        "query_num": MINICPMO_QUERIES, "image_size": 56, "patch_size": 14, "init_audio": False, "init_tts": False,
        "slice_mode": False, "vocab_size": vocab_size, "eos_token_id": [SPECIAL_TOKENS.index("<|im_end|>")],
        "mlxkv_tiny_model": {"family": "minicpmo", "hidden_size": hidden, "num_layers": layers, "seed": seed},
    }


OMNI_VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<|audio_start|>",
                      "<|audio_end|>", "<|audio_pad|>"]


def qwen3_omni_moe_config(vocab_size: int, ids: dict[str, int], hidden: int = 64, layers: int = 2, seed: int = 0,
                          **_) -> dict:
    """Qwen3-Omni's thinker: Qwen3-VL's tower, placeholders, M-RoPE and deepstack before a mixture-of-experts
    language model, an audio tower beside (no audio sent); no talker (enable_audio_output off)."""
    half = hidden // 4 // 2
    text = {"num_hidden_layers": layers, "hidden_size": hidden, "intermediate_size": 2 * hidden,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": hidden // 4, "num_experts": 4,
            "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "moe_intermediate_size": hidden, "rms_norm_eps": 1e-6, "vocab_size": vocab_size, "rope_theta": 10000.0,
            "max_position_embeddings": 4096,
            "rope_scaling": {"type": "default", "mrope_section": [half - 2 * (half // 3), half // 3, half // 3],
                             "interleaved": True}}
    thinker = {
        "text_config": text,
        "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "out_hidden_size": hidden,
                          "num_heads": 2, "patch_size": 16, "spatial_patch_size": 16, "spatial_merge_size": 2,
                          "temporal_patch_size": 2, "num_position_embeddings": 64, "deepstack_visual_indexes": [0]},
        "audio_config": {"d_model": 32, "encoder_layers": 1, "encoder_attention_heads": 2, "encoder_ffn_dim": 64,
                         "num_hidden_layers": 1, "output_dim": hidden, "downsample_hidden_size": 16},
        "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
        "audio_token_id": ids["<|audio_pad|>"], "audio_start_token_id": ids["<|audio_start|>"],
        "audio_end_token_id": ids["<|audio_end|>"], "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }
    return {
        "model_type": "qwen3_omni_moe", "architectures": ["Qwen3OmniMoeForConditionalGeneration"],
        "thinker_config": thinker, "enable_audio_output": False,
        "talker_config": {"text_config": {**text, "model_type": "qwen3_omni_moe_talker_text"}},
        "vision_config": thinker["vision_config"], "eos_token_id": SPECIAL_TOKENS.index("<|im_end|>"),
        "mlxkv_tiny_model": {"family": "qwen3_omni_moe", "hidden_size": hidden, "num_layers": layers, "seed": seed},
    }


FAMILIES = {
    "qwen3_omni_moe": (OMNI_VISION_TOKENS, qwen3_omni_moe_config, QWEN_VL_TEMPLATE,
                       {**QWEN3_VL_PREPROCESSOR, "feature_extractor_type": "WhisperFeatureExtractor",
                        "feature_size": 128, "processor_class": "Qwen3OmniMoeProcessor"},
                       "Qwen3OmniMoeProcessor",
                       {"extra_special_tokens": {
                           "image_token": "<|image_pad|>", "audio_token": "<|audio_pad|>",
                           "video_token": "<|video_pad|>",
                           "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
                           "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>"}}),
    "minicpmo": (MINICPMO_VISION_TOKENS, minicpmo_config, STRING_TEMPLATE,
                 {"patch_size": 14, "scale_resolution": 56, "image_feature_size": MINICPMO_QUERIES},
                 "MiniCPMOProcessor", {"unk_token": "<unk>"}),
    "llmjpvl": (LLMJPVL_VISION_TOKENS, llmjpvl_config, STRING_TEMPLATE, LLMJPVL_PREPROCESSOR, "Gemma3Processor",
                {"extra_special_tokens": {"boi_token": "<image>", "image_token": "<IMG_CONTEXT>",
                                          "eoi_token": "</img>"}}),
}
PROCESSOR_CONFIGS = {
    "llmjpvl": {"image_seq_length": 4, "processor_class": "Gemma3Processor"},
}
# family -> further files its processor reads (name -> content)
EXTRA_FILES = {
}
