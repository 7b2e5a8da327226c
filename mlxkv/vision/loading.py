"""Loading a checkpoint with a vision tower: as a vision model when mlx-vlm is installed.

Without the `vision` extra such a checkpoint loads as text-only through
mlx-lm (one log line says so). A family mlxkv does not serve with images
(families.py says why) loads its text half when mlx-lm has a class for it,
with one log line naming the family and the reason; without one it is
refused with that line. A family mlx-vlm has no class for loads as text.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from mlxkv.errors import MlxkvError, first_line
from mlxkv.vision import compat
from mlxkv.vision.families import NOT_SERVED, SERVED

log = logging.getLogger(__name__)

# mlx-vlm families whose language model runs over mlxkv's pool with images (tests/vision).
VISION_FAMILIES = SERVED


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
    if not compat.available():
        log.info("%s has a vision tower; loading its text half only (pip install 'mlxkv[vision]' for images)", name)
        return None
    family = compat.model_type(config)  # after available(): the import is paid only with the extra
    if family not in VISION_FAMILIES:
        _text_half_or_refuse(name, family, config.get("model_type"))
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


def _text_half_or_refuse(name: str, family, model_type) -> None:
    """Log why `family`'s images are not served and let its text half load; raise if it has none.

    `model_type` is the config's own: mlx-lm, which loads the text half, remaps it its own way."""
    reason = NOT_SERVED.get(family)
    if reason is None:
        log.info("%s: mlx-vlm has no class for family %r; loading it as text", name, family)
    elif _has_text_class(model_type):
        log.info("%s: images with %r are not served (%s); loading its text half only", name, family, reason)
    else:
        raise MlxkvError(f"{name}: mlx-vlm family {family!r} cannot run over mlxkv's pool: {reason}")


def _has_text_class(family) -> bool:
    """Whether mlx-lm has a model class for `family` (its text half)."""
    from mlxkv.models import compat as lm_compat

    return isinstance(family, str) and lm_compat.has_model_class(family)
