"""The mlx-lm internals mlxkv relies on (models/compat.py) are still there, and
every supported family's attention really runs on the paged path."""

from __future__ import annotations

from collections import Counter

import pytest

import mlxkv  # noqa: F401  (before mlx: it loads the BLAS)
from mlxkv.attention import dispatch
from mlxkv.attention.paged_cache import PagedKVCache
from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.models import compat
from mlxkv.models.loader import load_model
from mlxkv.models.tiny import FAMILIES, TinyModelSpec, write_tiny_model
from mlxkv.models.tiny_families import MIN_LAYERS

SUPPORTED = list(FAMILIES)
# deepseek_v32 hands attention its CacheList (latent and indexer), with the rotary scores
# as an additive mask: mlx-lm's own function serves it, on the K/V the paged caches gathered.
CACHELIST_ATTENTION = {"deepseek_v32"}
MAX_TOKENS = 4


def test_the_private_names_compat_takes_exist():
    from mlx_lm.models import base, cache

    assert compat.BaseCache is cache._BaseCache
    assert callable(base.scaled_dot_product_attention)
    assert compat.model_file_patterns()  # the loader's file list
    model_class, args_class = compat.model_classes("mistral")
    assert model_class.__module__ == "mlx_lm.models.llama"  # remapped as mlx_lm.load does
    assert hasattr(args_class, "from_dict")
    quantized = compat.quantized_kv_cache(32, 4)  # the quantized pool's peer (benchmarks/kv_formats.py)
    assert (quantized.group_size, quantized.bits, quantized.offset) == (32, 4, 0)
    import mlx.nn as nn

    model = nn.Sequential(nn.Linear(64, 64))
    nn.quantize(model, group_size=32, bits=4)
    compat.dequantize_model(model)  # the quality rows' float copy of the demo model
    assert type(model.layers[0]) is nn.Linear


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: str(write_tiny_model(root / f, TinyModelSpec(family=f, seed=11, num_layers=max(2, MIN_LAYERS.get(f, 1)))))
            for f in SUPPORTED}


@pytest.mark.parametrize("family", SUPPORTED)
def test_every_layer_of_every_supported_family_attends_through_the_paged_path(family, family_dirs, monkeypatch):
    calls = Counter()
    paged = dispatch.paged_attention

    def counted(queries, keys, values, cache, scale, mask, sinks=None):
        assert isinstance(cache, PagedKVCache)
        calls[cache.slot] += 1
        return paged(queries, keys, values, cache, scale, mask, sinks)

    monkeypatch.setattr(dispatch, "paged_attention", counted)
    loaded = load_model(family_dirs[family])
    engine = Engine(loaded, CacheConfig(block_size=16, num_blocks=32, memory_tier_bytes=0))
    result = engine.generate([3, 4, 5, 6, 7], max_tokens=MAX_TOKENS)
    assert len(result.tokens) == MAX_TOKENS
    # One prefill forward, then a decode forward per token after the first
    # (the pipeline queues one more, computed and dropped, at the end).
    forwards = {1 + MAX_TOKENS - 1, 1 + MAX_TOKENS}
    # Every attention slot (a hybrid's recurrent slots keep mlx-lm's ArraysCache; a
    # CacheList's parts are (slot, part)).
    layout = engine.coordinator.group_layout
    attention_slots = {slot for group in layout.groups for slot in group.slots}
    covered = {s if isinstance(s, int) else s[0] for s in attention_slots | set(layout.recurrent)}
    assert covered == set(range(layout.num_slots))
    if family in CACHELIST_ATTENTION:
        assert not calls, f"{family}: its attention now takes a paged cache"
        return
    assert set(calls) == attention_slots, f"{family}: layers off the paged path"
    assert all(n in forwards for n in calls.values()), calls


def test_a_model_whose_module_cannot_be_routed_is_said_in_the_log(caplog):
    class Unroutable:
        pass

    with caplog.at_level("WARNING", logger="mlxkv"):
        assert compat.route_attention(Unroutable(), lambda original: original) is False
    assert any("scaled_dot_product_attention" in r.getMessage() for r in caplog.records)


def test_the_tokenizer_internals_structured_output_takes_exist(llama_dir):
    from transformers import PreTrainedTokenizerBase

    tokenizer = compat.load_tokenizer(llama_dir)
    assert isinstance(compat.hf_tokenizer(tokenizer), PreTrainedTokenizerBase)  # llguidance builds on it
    assert compat.tool_parser_name(tokenizer) == "json_tools"  # the tiny template's <tool_call> format
