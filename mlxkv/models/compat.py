"""The one place mlxkv touches mlx-lm's internals.

Everything here is a name mlx-lm does not promise to keep: a private base
class, a module attribute we rebind, a table of its loader. When mlx-lm
changes one of them, tests/models/test_compat.py fails here, not somewhere
downstream with a wrong answer.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from collections.abc import Callable

from mlx_lm.models.cache import (  # noqa: F401
    ArraysCache, CacheList, _BaseCache, create_attention_mask, create_causal_mask, make_prompt_cache,
)

log = logging.getLogger(__name__)

# The base class of mlx-lm's cache objects: a paged cache subclasses it so
# that mlx-lm code that checks for it (and its default methods) works.
BaseCache = _BaseCache

# The name each model module imports from mlx_lm.models.base and calls.
_ATTENTION_NAME = "scaled_dot_product_attention"
_ROUTED = "_mlxkv_routed"


def route_attention(model, routed: Callable[[Callable], Callable]) -> bool:
    """Rebind the attention function the model's module calls to `routed(original)`.

    mlx-lm model modules call `scaled_dot_product_attention`, imported from
    `mlx_lm.models.base` into their own namespace. Wrapping that name in the
    model's module routes our caches to us and leaves every other model of
    the family (an mlx-lm run in the same process) on the original. Returns
    False, and logs why, when the module has no such name.
    """
    # A vision model names the module of its language model's layers (vision/model.py).
    module = sys.modules[getattr(model, "attention_module", None) or type(model).__module__]
    original = getattr(module, _ATTENTION_NAME, None)
    if original is None:
        log.warning("%s has no %s to route; attention takes the gathered K/V", module.__name__, _ATTENTION_NAME)
        return False
    if getattr(original, _ROUTED, False):
        return True
    wrapper = routed(original)
    setattr(wrapper, _ROUTED, True)
    setattr(module, _ATTENTION_NAME, wrapper)
    return True


def model_classes(model_type: str):
    """(Model, ModelArgs) of an mlx-lm family, as its loader picks them (mistral -> llama)."""
    from mlx_lm.utils import MODEL_REMAPPING  # deferred: pulls in transformers

    arch = importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}")
    return arch.Model, arch.ModelArgs


def has_model_class(model_type: str) -> bool:
    """Whether mlx-lm's loader has a class for `model_type` (after its remapping: llava -> mistral3),
    without importing the module."""
    from mlx_lm.utils import MODEL_REMAPPING  # deferred: pulls in transformers

    name = MODEL_REMAPPING.get(model_type, model_type)
    return name.isidentifier() and importlib.util.find_spec(f"mlx_lm.models.{name}") is not None


def family_modules() -> list[str]:
    """The names of mlx-lm's model modules (families, and a few shared helpers), without importing them:
    importing one can end the process (olmo's, without its extra package)."""
    import pkgutil

    import mlx_lm.models

    return sorted(m.name for m in pkgutil.iter_modules(mlx_lm.models.__path__))


def family_classes(module: str):
    """(Model, ModelArgs) of an mlx-lm model module by its own name; AttributeError for a helper module."""
    arch = importlib.import_module(f"mlx_lm.models.{module}")
    return arch.Model, arch.ModelArgs


def model_file_patterns() -> list[str]:
    """The files mlx_lm.load reads from a model repository."""
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    return list(DEFAULT_ALLOW_PATTERNS)


def load_tokenizer(path: str, eos_token_ids=None):
    """mlx-lm's TokenizerWrapper for a model directory, without its weights."""
    from mlx_lm.utils import load_tokenizer as mlx_lm_load_tokenizer

    return mlx_lm_load_tokenizer(path, eos_token_ids=eos_token_ids)


def hf_tokenizer(tokenizer):
    """The Hugging Face tokenizer inside mlx-lm's TokenizerWrapper (llguidance builds its own from
    it); a Hugging Face tokenizer as it is (its own `_tokenizer` is the Rust one)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    return tokenizer._tokenizer if isinstance(tokenizer, TokenizerWrapper) else tokenizer


def added_token_id(tokenizer, text: str) -> int | None:
    """The id of `text` when it is one added token of the tokenizer (Qwen's <tool_call>), else None."""
    added = getattr(hf_tokenizer(tokenizer), "added_tokens_decoder", None) or {}
    for token_id, token in added.items():
        if str(token) == text:
            return int(token_id)
    return None


def tool_parser_name(tokenizer) -> str | None:
    """The short name of mlx-lm's tool parser for this tokenizer ("json_tools", "mistral", ...;
    None without tool calling): its module under mlx_lm.tool_parsers."""
    if not getattr(tokenizer, "has_tool_calling", False):
        return None
    parser = getattr(tokenizer, "tool_parser", None)
    return getattr(parser, "__module__", "").rsplit(".", 1)[-1] or None


def dequantize_model(model):
    """The model with its quantized layers made plain (mlx-lm's own): on a CPU the quantized
    matmul of a prefill runs ~20x slower than a float one."""
    from mlx_lm.utils import dequantize_model as mlx_lm_dequantize_model

    return mlx_lm_dequantize_model(model)


def quantized_kv_cache(group_size: int, bits: int):
    """mlx-lm's QuantizedKVCache: the peer of a quantized pool."""
    from mlx_lm.models.cache import QuantizedKVCache

    return QuantizedKVCache(group_size=group_size, bits=bits)


def cache_layout(model) -> list:
    """The model's own cache objects, one per cache slot: what it would run mlx-lm with."""
    return make_prompt_cache(model)


def layer_cache(window: int):
    """deepseek_v41's own per-layer cache (its sliding window, compressed KV and index keys)."""
    from mlx_lm.models.deepseek_v41 import LayerCache  # deferred: only that family has it

    return LayerCache(window)


# LayerCache's arrays, in the order a state checkpoint keeps them.
LAYER_CACHE_FIELDS = ("window", "compress_kv", "index_k", "pending_kv", "pending_gate")

# Families whose own code misplaces the rows of a batch padded to its longest
# row, so their decode rows run one at a time (the family sweep,
# tests/models/test_family_sweep.py, compares a batch with solo runs):
ONE_ROW_FAMILIES = {
    "afm7": "its KV-reuse layers take the rotary offset from the fetched K's length",
    "minimax_m3_vl": "its indexer places queries at the end of the fetched K",
    "gemma2": "its attention groups queries per KV head, which a [B, 1, L, T] mask does not broadcast over",
    "gpt_bigcode": "its position ids are numpy ranges from one offset",
    "phi3small": "its block-sparse layers place queries at the end of the fetched K",
}


def batches_rows(model_type: str) -> bool:
    """Whether decode rows of this family can share one forward (see ONE_ROW_FAMILIES)."""
    return model_type not in ONE_ROW_FAMILIES
