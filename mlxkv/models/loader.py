"""Loading an mlx-lm model and checking that mlxkv can page it."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from mlxkv.cache.kv_pool import KVLayout
from mlxkv.cache.layer_groups import GroupLayout, group_layout
from mlxkv.errors import MlxkvError, first_line
from mlxkv.models import compat
from mlxkv.models.fetch import local_model

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: object  # mlx_lm TokenizerWrapper
    config: dict
    name: str

    @property
    def model_type(self) -> str:
        return self.config.get("model_type", "unknown")

    @property
    def max_context(self) -> int | None:
        return self.config.get("max_position_embeddings")

    @property
    def vocab_size(self) -> int | None:
        """Rows of the embedding table: a token id must be below it."""
        return self.config.get("vocab_size") or self.config.get("text_config", {}).get("vocab_size")

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)


def load_model(name: str) -> LoadedModel:
    """Load a local path or a Hugging Face id through mlx_lm.load."""
    from mlx_lm import load  # heavy import; keep `import mlxkv` light

    path = local_model(name) or name  # a Hugging Face id: mlx_lm.load downloads it
    try:
        model, tokenizer, config = load(path, return_config=True)
    except Exception as e:  # mlx-lm raises many kinds; the user needs one line
        log.debug("loading %s failed", name, exc_info=True)
        reason = first_line(e)
        raise MlxkvError(f"could not load model {name!r}: {reason}") from None
    loaded = LoadedModel(model, tokenizer, config, name)
    check_supported(loaded)
    return loaded


def load_tokenizer(name: str):
    """The tokenizer of model `name` alone: chat prompts need no weights and no pool."""
    path = local_model(name) or name
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    try:
        return compat.load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except Exception as e:  # mlx-lm raises many kinds; the user needs one line
        log.debug("loading the tokenizer of %s failed", name, exc_info=True)
        reason = first_line(e)
        raise MlxkvError(f"could not load the tokenizer of {name!r}: {reason}") from None


def check_supported(loaded: LoadedModel) -> GroupLayout:
    """The model's layer groups; MlxkvError naming what mlxkv cannot page."""
    if not hasattr(loaded.model, "layers"):
        raise MlxkvError(f"unsupported model family {loaded.model_type!r}: no .layers to page")
    try:
        return group_layout(compat.cache_layout(loaded.model))
    except MlxkvError as e:
        raise MlxkvError(f"unsupported model family {loaded.model_type!r}: {e}") from None


def probe_kv_layout(loaded: LoadedModel, block_size: int) -> KVLayout:
    """Run one token through the model to learn what its layers store.

    Reading shapes off configs differs per family; what `update_and_fetch`
    receives, on the model's own cache objects, is the ground truth. Every
    attention layer must store the same shape: they share the pool's pages.
    """
    layout = check_supported(loaded)
    caches = compat.cache_layout(loaded.model)
    seen: dict[int, tuple] = {}
    for slot, cache in enumerate(caches):
        if slot not in layout.recurrent:
            cache.update_and_fetch = _recording(cache.update_and_fetch, seen, slot)
    mx.eval(loaded.model(mx.array([[0]]), cache=caches))
    missing = [slot for slot in range(len(caches)) if slot not in seen and slot not in layout.recurrent]
    if missing:
        raise MlxkvError(f"unsupported model family {loaded.model_type!r}: cache slots {missing[:4]} "
                         "do not use the KV cache protocol")
    shapes = {(k[1], k[3], v[3], dtype) for k, v, dtype in seen.values()}
    if len(shapes) > 1:
        raise MlxkvError(f"unsupported model family {loaded.model_type!r}: its layers store K/V of "
                         f"{len(shapes)} different shapes, and mlxkv pages one shape per pool")
    ((n_kv_heads, head_dim, v_head_dim, dtype),) = shapes
    return KVLayout(layout.page_layers, n_kv_heads, head_dim, v_head_dim, block_size, dtype, layout)


def _recording(update_and_fetch, seen: dict, slot: int):
    def record(keys, values):
        seen[slot] = (keys.shape, values.shape, keys.dtype)
        return update_and_fetch(keys, values)

    return record
