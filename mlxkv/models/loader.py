"""Loading an mlx-lm model and checking that mlxkv can page it."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from mlxkv.cache.kv_pool import KVLayout
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


def check_supported(loaded: LoadedModel) -> None:
    """Only models whose every layer uses mlx-lm's plain KVCache are paged."""
    model = loaded.model
    if not hasattr(model, "layers"):
        raise MlxkvError(f"unsupported model family {loaded.model_type!r}: no .layers to page")
    if hasattr(model, "make_cache"):
        kinds = {type(c).__name__ for c in model.make_cache() if type(c) is not KVCache}
        if kinds:
            raise MlxkvError(
                f"unsupported model family {loaded.model_type!r}: it uses "
                f"{', '.join(sorted(kinds))} layers, and mlxkv pages only plain KVCache attention"
            )


class _ProbeCache(KVCache):
    """Records the K/V shape and dtype a layer writes."""

    def update_and_fetch(self, keys, values):
        self.seen = (keys.shape, values.shape, keys.dtype)
        return super().update_and_fetch(keys, values)


def probe_kv_layout(loaded: LoadedModel, block_size: int) -> KVLayout:
    """Run one token through the model to learn what its layers store.

    Reading shapes off configs differs per family; what `update_and_fetch`
    receives is the ground truth for every family.
    """
    caches = [_ProbeCache() for _ in range(loaded.num_layers)]
    mx.eval(loaded.model(mx.array([[0]]), cache=caches))
    missing = [i for i, c in enumerate(caches) if not hasattr(c, "seen")]
    if missing:
        raise MlxkvError(
            f"unsupported model family {loaded.model_type!r}: layers {missing[:4]} "
            "do not use the KV cache protocol"
        )
    k_shape, v_shape, dtype = caches[0].seen
    return KVLayout(
        num_layers=loaded.num_layers,
        n_kv_heads=k_shape[1],
        head_dim=k_shape[3],
        v_head_dim=v_shape[3],
        block_size=block_size,
        dtype=dtype,
    )
