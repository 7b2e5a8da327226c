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
from mlxkv.cache.page_format import EMPTY, KEYS, OWN, KVShape
from mlxkv.errors import MlxkvError, first_line
from mlxkv.models import compat
from mlxkv.models.fetch import Report, fetch_model, local_model

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
    from mlxkv.vision.loading import load_vision_model  # None: no vision tower, or no mlx-vlm (logged)

    vision = load_vision_model(path, name, LoadedModel)
    if vision is not None:
        check_supported(vision)
        return vision
    try:
        model, tokenizer, config = load(path, return_config=True)
    except Exception as e:  # mlx-lm raises many kinds; the user needs one line
        log.debug("loading %s failed", name, exc_info=True)
        _refuse_an_encoder(name)
        reason = first_line(e)
        raise MlxkvError(f"could not load model {name!r}: {reason}") from None
    loaded = LoadedModel(model, tokenizer, config, name)
    check_supported(loaded)
    return loaded


def _refuse_an_encoder(name: str) -> None:
    """An encoder embedding model (BERT and its kind) is no decoder for mlx-lm: say what serves it."""
    from mlxkv.models.encoder import checkpoint_config, encoder_family

    family = encoder_family(checkpoint_config(name))
    if family is not None:
        raise MlxkvError(f"model {name!r} is an embedding model ({family}): `mlxkv serve` serves it on "
                         "/v1/embeddings; it cannot chat or generate")


def load_named(name: str, report: Report = lambda what, fraction: None) -> LoadedModel:
    """The one way a model is loaded, target, draft or the host's: fetch `name` (a path, a
    Hugging Face id, "demo"; downloads report their progress), load it, and keep `name`."""
    path = fetch_model(name, report)
    report(f"loading {name}", None)
    loaded = load_model(path)
    loaded.name = name
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
    """The model's layer groups (before probing shapes); MlxkvError naming what mlxkv cannot page."""
    if not hasattr(loaded.model, "layers"):
        raise MlxkvError(f"unsupported model family {loaded.model_type!r}: no .layers to page")
    try:
        return group_layout(compat.cache_layout(loaded.model))
    except MlxkvError as e:
        raise MlxkvError(f"unsupported model family {loaded.model_type!r}: {e}") from None


def probe_kv_layout(loaded: LoadedModel, block_size: int) -> KVLayout:
    """Run one token through the model to learn what its layers store.

    Reading shapes off configs differs per family; what `update_and_fetch`
    receives, on the model's own cache objects, is the ground truth: each
    attention slot's K/V shape (slots of different shapes share pages,
    cache/page_format.py), whether it stores values at all, the window a
    sliding slot's mask asks for, and which slots the model never writes.
    """
    check_supported(loaded)
    caches = compat.cache_layout(loaded.model)
    seen: dict = {}
    windows: dict[int, int] = {}
    leaves = _attention_leaves(caches)
    for path, cache in leaves:
        cache.update_and_fetch = _recording(cache.update_and_fetch, seen, path)
        if type(cache).__name__ == "RotatingKVCache":
            cache.make_mask = _asking(cache.make_mask, windows, int(cache.max_size))
    mx.eval(loaded.model(mx.array([[0]]), cache=caches))
    dtypes = {dtype for _, _, _, dtype in seen.values()}
    if len(dtypes) > 1:
        raise MlxkvError(f"unsupported model family {loaded.model_type!r}: its layers store K/V in "
                         f"{len(dtypes)} dtypes, and mlxkv pages one")
    shapes = {path: _shape(*seen[path][:3]) for path, _ in leaves if path in seen}
    unused = tuple(path for path, _ in leaves if path not in seen)
    try:
        layout = group_layout(caches, shapes, windows, unused, compat.batches_rows(loaded.model_type))
    except MlxkvError as e:
        raise MlxkvError(f"unsupported model family {loaded.model_type!r}: {e}") from None
    dtype = dtypes.pop() if dtypes else _state_dtype(caches)
    if not layout.groups:  # state slots alone (Mamba, RWKV-7): no pages
        return KVLayout(0, 1, 1, 1, block_size, dtype, layout)
    if layout.page is not None:
        page = layout.page
        return KVLayout(layout.page_layers, page.k_heads, page.k_dim, page.v_dim, block_size, dtype, layout,
                        page.v_heads)
    shape = next(iter(shapes.values()))
    return KVLayout(layout.page_layers, shape.k_heads, shape.k_dim, shape.v_dim, block_size, dtype, layout)


def _attention_leaves(caches: list) -> list[tuple]:
    """(slot, cache) of every cache object that speaks the KV protocol, parts of a CacheList as (slot, part)."""
    leaves = []
    for slot, cache in enumerate(caches):
        parts = [(slot, cache)] if type(cache).__name__ != "CacheList" else list(
            ((slot, i), part) for i, part in enumerate(cache.caches))
        leaves += [(path, c) for path, c in parts if hasattr(c, "update_and_fetch")
                   and type(c).__name__ not in ("ArraysCache", "LayerCache")]
    return leaves


def _shape(keys_shape, values_shape, same: bool) -> KVShape:
    values = KEYS if same else EMPTY if values_shape[3] == 0 else OWN
    return KVShape(keys_shape[1], keys_shape[3], values_shape[1], values_shape[3], values)


def _state_dtype(caches: list):
    """The dtype of a state-only model's states, after the probe's token."""
    for cache in caches:
        for array in getattr(cache, "cache", ()):
            if array is not None:
                return array.dtype
    return mx.float32


def _recording(update_and_fetch, seen: dict, path):
    def record(keys, values):
        seen[path] = (keys.shape, values.shape, values is keys, keys.dtype)
        return update_and_fetch(keys, values)

    return record


def _asking(make_mask, windows: dict[int, int], size: int):
    """make_mask, noting a window the model asks for other than its cache's size (plamo3 asks size + 1)."""
    def ask(*args, **kwargs):
        window = kwargs.get("window_size")
        if window is not None and window != size:
            windows[size] = window
        return make_mask(*args, **kwargs)

    return ask
