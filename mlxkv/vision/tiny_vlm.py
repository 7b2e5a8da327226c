"""Tiny random-weight vision-language models, written offline from mlx-vlm's classes.

Like models/tiny.py: a directory `mlx_vlm.load` opens as it would a
downloaded checkpoint (config.json, model.safetensors, tokenizer files,
preprocessor_config.json). The tokenizer is tiny.py's own built-in BPE
(the demo model's GGUF is not installed everywhere, and a tokenizer
trained here is byte-identical on every machine) plus the family's vision
tokens; the weights are drawn from the seed by mlx-vlm's model class.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from mlxkv.errors import MlxkvError
from mlxkv.models.tiny import SPECIAL_TOKENS, _tokenizer, random_weights
from mlxkv.vision import compat

VISION_FAMILIES = ("qwen2_vl",)
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


def qwen2_vl_config(vocab_size: int, ids: dict[str, int], hidden: int = 64, layers: int = 2, seed: int = 0) -> dict:
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
            "model_type": "qwen2_vl", "depth": 1, "embed_dim": 32, "hidden_size": hidden, "num_heads": 2,
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


def write_tiny_vlm(path: str | Path, family: str = "qwen2_vl", seed: int = 0, vocab_size: int = 512) -> Path:
    """Write a tiny random-weight VLM of `family` to `path` (created or overwritten)."""
    if family not in VISION_FAMILIES:
        raise MlxkvError(f"no tiny vision model for {family!r}; one of {', '.join(VISION_FAMILIES)}")
    if not compat.available():
        raise MlxkvError(f"a tiny {family} needs mlx-vlm: pip install 'mlxkv[vision]'")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(vocab_size)
    tokenizer.add_special_tokens(QWEN_VISION_TOKENS)
    ids = {t: tokenizer.token_to_id(t) for t in QWEN_VISION_TOKENS}
    config = qwen2_vl_config(tokenizer.get_vocab_size(), ids, seed=seed)
    model = compat.build_model(config)
    weights = random_weights(model, seed, mx.float32)
    mx.save_safetensors(str(path / "model.safetensors"), weights, {"format": "mlx"})
    tokenizer.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "chat_template": QWEN_VL_TEMPLATE, "model_max_length": 4096,
        "clean_up_tokenization_spaces": False, "processor_class": "Qwen2VLProcessor",
    }
    files = {"config.json": config, "tokenizer_config.json": tokenizer_config,
             "preprocessor_config.json": PREPROCESSOR,
             "chat_template.json": {"chat_template": QWEN_VL_TEMPLATE}}
    for name, content in files.items():
        (path / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
    return path
