"""The tiny models of LLaVA 1.5 and the families whose merge inserts an image's features
(families.INSERTS; vision/expansion.py): their configs and processors' files, a block of
tiny_families.py's table of their own."""

from __future__ import annotations

from mlxkv.models.tiny import SPECIAL_TOKENS
from mlxkv.vision.tiny_configs import QWEN_VL_TEMPLATE

LLAVA_TOKENS = ["<image>", "<video>"]
LLAVA_TEMPLATE = QWEN_VL_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<image>")
LLAVA_SIDE = 28  # pixels a (tile's) side: (28 / 14)^2 = 4 patches, a feature each after the CLS is dropped
_CLIP_MEAN, _CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]


def _llama(vocab_size: int, hidden: int, layers: int) -> dict:
    return {"model_type": "llama", "hidden_size": hidden, "num_hidden_layers": layers,
            "intermediate_size": 2 * hidden, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5, "vocab_size": vocab_size, "rope_theta": 10000.0, "max_position_embeddings": 4096}


def _clip() -> dict:
    return {"model_type": "clip_vision_model", "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
            "num_attention_heads": 2, "patch_size": 14, "image_size": LLAVA_SIDE, "projection_dim": 32}


def llava_config(vocab_size: int, ids: dict[str, int], hidden: int = 64, layers: int = 2, seed: int = 0,
                 **_) -> dict:
    """LLaVA 1.5: a CLIP tower (its second-to-last layer, CLS dropped), `<image>` x patches an image,
    written over by the projected features; a Llama."""
    return {
        "model_type": "llava", "architectures": ["LlavaForConditionalGeneration"],
        "text_config": _llama(vocab_size, hidden, layers), "vision_config": _clip(),
        "image_token_index": ids["<image>"], "vision_feature_select_strategy": "default",
        "vision_feature_layer": -2, "vocab_size": vocab_size, "eos_token_id": [SPECIAL_TOKENS.index("<|im_end|>")],
        "mlxkv_tiny_model": {"family": "llava", "hidden_size": hidden, "num_layers": layers, "seed": seed},
    }


CLIP_PREPROCESSOR = {
    "image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": LLAVA_SIDE},
    "crop_size": {"height": LLAVA_SIDE, "width": LLAVA_SIDE}, "do_resize": True, "do_center_crop": True,
    "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
    "image_mean": _CLIP_MEAN, "image_std": _CLIP_STD, "resample": 3,
}

LLAVA_PINPOINTS = [[LLAVA_SIDE, 2 * LLAVA_SIDE], [2 * LLAVA_SIDE, LLAVA_SIDE], [2 * LLAVA_SIDE, 2 * LLAVA_SIDE]]


def llava_next_config(vocab_size: int, ids: dict[str, int], hidden: int = 64, layers: int = 2, seed: int = 0,
                      **_) -> dict:
    """LLaVA-NeXT (1.6): LLaVA 1.5's CLIP tower and Llama over AnyRes tiles (the base view, then the best
    pinpoint's tiles), and an image_newline vector; its merge inserts an image's features (expansion.py)."""
    config = llava_config(vocab_size, ids, hidden, layers, seed)
    config.update(model_type="llava_next", architectures=["LlavaNextForConditionalGeneration"],
                  image_grid_pinpoints=LLAVA_PINPOINTS)
    config["mlxkv_tiny_model"]["family"] = "llava_next"
    return config


LLAVA_NEXT_PREPROCESSOR = {
    **CLIP_PREPROCESSOR, "image_processor_type": "LlavaNextImageProcessor", "processor_class": "LlavaNextProcessor",
    "image_grid_pinpoints": LLAVA_PINPOINTS, "do_pad": True,
}

def granite_vision_config(vocab_size: int, ids: dict[str, int], hidden: int = 64, layers: int = 2, seed: int = 0,
                          **_) -> dict:
    """Granite Vision: LLaVA-NeXT's tiles, newline and merge over a SigLIP tower (two of its layers'
    output side by side, no CLS: the "full" strategy) and a Granite language model."""
    config = llava_next_config(vocab_size, ids, hidden, layers, seed)
    config["text_config"].update(model_type="granite", embedding_multiplier=12.0, attention_multiplier=0.25,
                                 residual_multiplier=0.22, logits_scaling=8.0, tie_word_embeddings=True)
    config["vision_config"].update(model_type="siglip_vision_model", layer_norm_eps=1e-6)
    config.update(model_type="granite_vision", architectures=["LlavaNextForConditionalGeneration"],
                  vision_feature_select_strategy="full", vision_feature_layer=[-2, -1])
    config["mlxkv_tiny_model"]["family"] = "granite_vision"
    return config


# family -> (vision tokens, config, template, preprocessor, processor class, tokenizer extras)
LLAVA_FAMILIES = {
    "llava": (LLAVA_TOKENS, llava_config, LLAVA_TEMPLATE, {**CLIP_PREPROCESSOR, "processor_class": "LlavaProcessor"},
              "LlavaProcessor", {}),
    "llava_next": (LLAVA_TOKENS, llava_next_config, LLAVA_TEMPLATE, LLAVA_NEXT_PREPROCESSOR, "LlavaNextProcessor", {}),
    "granite_vision": (LLAVA_TOKENS, granite_vision_config, LLAVA_TEMPLATE,
                       {**LLAVA_NEXT_PREPROCESSOR, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
                        "processor_class": "GraniteVisionProcessor"}, "GraniteVisionProcessor", {}),
}
LLAVA_PROCESSOR_CONFIGS = {
    # LLaVA 1.5's own: one more token the tower makes (its CLS), dropped by the "default" strategy
    "llava": {"patch_size": 14, "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1,
              "image_token": "<image>", "processor_class": "LlavaProcessor"},
    "llava_next": {"patch_size": 14, "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1,
                   "image_token": "<image>", "processor_class": "LlavaNextProcessor"},
    "granite_vision": {"patch_size": 14, "vision_feature_select_strategy": "full", "image_token": "<image>",
                       "processor_class": "GraniteVisionProcessor"},
}
