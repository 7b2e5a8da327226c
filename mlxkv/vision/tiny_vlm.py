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
from mlxkv.models.tiny import _tokenizer, random_weights
from mlxkv.vision import compat
from mlxkv.vision.families import SERVED as VISION_FAMILIES  # a tiny model of each
from mlxkv.vision.tiny_configs import GEMMA3_IMAGE_TOKENS, IDEFICS2_IMAGE_TOKENS, SMOLVLM_TILE_TOKENS
from mlxkv.vision.tiny_families import FAMILIES, PROCESSOR_CONFIGS
from mlxkv.vision.tiny_token_families import EXTRA_FILES


def write_tiny_vlm(path: str | Path, family: str = "qwen2_vl", seed: int = 0, vocab_size: int = 512,
                   hidden: int = 64, layers: int = 2, max_pixels: int | None = None, **vision) -> Path:
    """`vision`: the vision tower's shape (qwen2_vl: vision_depth, vision_dim), for benchmarks;
    `max_pixels`: a Qwen processor's cap, so a benchmark's images take their real token counts."""
    if family not in FAMILIES:
        raise MlxkvError(f"no tiny vision model for {family!r}; one of {', '.join(VISION_FAMILIES)}")
    if not compat.available():
        raise MlxkvError(f"a tiny {family} needs mlx-vlm: pip install 'mlxkv[vision]'")
    vision_tokens, make_config, template, preprocessor, processor_class, extras = FAMILIES[family]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(vocab_size)
    tokenizer.add_special_tokens(vision_tokens)
    ids = {t: tokenizer.token_to_id(t) for t in vision_tokens}
    config = make_config(tokenizer.get_vocab_size(), ids, hidden=hidden, layers=layers, seed=seed, **vision)
    model = compat.build_model(config)
    weights = random_weights(model, seed, mx.float32)
    mx.save_safetensors(str(path / "model.safetensors"), weights, {"format": "mlx"})
    tokenizer.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "chat_template": template, "model_max_length": 4096,
        "clean_up_tokenization_spaces": False, "processor_class": processor_class, **extras,
    }
    if max_pixels is not None:
        preprocessor = {**preprocessor, "max_pixels": max_pixels}
    files = {"config.json": config, "tokenizer_config.json": tokenizer_config,
             "preprocessor_config.json": preprocessor, "chat_template.json": {"chat_template": template}}
    if family == "gemma3":  # mlx-vlm's Gemma3Processor reads its image count from here
        files["processor_config.json"] = {"image_seq_length": GEMMA3_IMAGE_TOKENS, "processor_class": processor_class}
    if family in ("smolvlm", "idefics3"):  # and their processors their tokens per tile
        files["processor_config.json"] = {"image_seq_len": SMOLVLM_TILE_TOKENS, "processor_class": processor_class}
    if family == "idefics2":
        files["processor_config.json"] = {"image_seq_len": IDEFICS2_IMAGE_TOKENS, "processor_class": processor_class}
    if family in ("mistral3", "pixtral"):  # their processors' placeholder tokens and patch merge
        files["processor_config.json"] = {"image_token": "[IMG]", "image_break_token": "[IMG_BREAK]",
                                          "image_end_token": "[IMG_END]", "patch_size": 14,
                                          "spatial_merge_size": 2 if family == "mistral3" else 1,
                                          "processor_class": processor_class}
    if family in PROCESSOR_CONFIGS:
        files["processor_config.json"] = PROCESSOR_CONFIGS[family]
    files.update(EXTRA_FILES.get(family, {}))
    for name, content in files.items():
        (path / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
    return path
