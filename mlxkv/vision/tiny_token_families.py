"""The tiny vision models of the families whose processors take the image token in string content
(vision/rendering.py writes it there): their configs and processor files, appended to
tiny_families.py's table."""

from __future__ import annotations

from mlxkv.models.tiny import SPECIAL_TOKENS
from mlxkv.vision.tiny_configs import QWEN_VL_TEMPLATE

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
FAMILIES = {
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
