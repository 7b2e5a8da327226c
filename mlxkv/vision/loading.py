"""Loading a checkpoint with a vision tower: as a vision model when mlx-vlm is installed.

Without the `vision` extra such a checkpoint loads as text-only through
mlx-lm (one log line says so). Families mlxkv has not run over its pool
with images load text-only too, with a log line naming the family.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from mlxkv.errors import MlxkvError, first_line
from mlxkv.vision import compat

log = logging.getLogger(__name__)

# mlx-vlm families whose language model runs over mlxkv's pool with images (tests/vision).
VISION_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "gemma3", "smolvlm", "idefics3", "qwen3_vl", "mistral3", "pixtral")


def checkpoint_config(path) -> dict | None:
    """A local checkpoint's config.json with a vision tower, else None."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return None
    return config if isinstance(config, dict) and config.get("vision_config") else None


def load_vision_model(path, name: str, loaded_model_class):
    """A LoadedModel whose model is a VisionModel, or None: load `path` as text (logged)."""
    config = checkpoint_config(path)
    if config is None:
        return None
    family = config.get("model_type")
    if not compat.available():
        log.info("%s has a vision tower; loading its text half only (pip install 'mlxkv[vision]' for images)", name)
        return None
    if family not in VISION_FAMILIES:
        log.info("%s: images with %r are not supported yet; loading its text half only", name, family)
        return None
    from mlxkv.models import compat as lm_compat
    from mlxkv.vision.model import VisionModel

    try:
        vlm, processor = compat.load(str(path))
        tokenizer = lm_compat.load_tokenizer(str(path), eos_token_ids=config.get("eos_token_id"))
    except Exception as e:  # mlx-vlm raises many kinds; the user needs one line
        log.debug("loading %s failed", name, exc_info=True)
        raise MlxkvError(f"could not load vision model {name!r}: {first_line(e)}") from None
    return loaded_model_class(VisionModel(vlm, processor), tokenizer, config, name)
