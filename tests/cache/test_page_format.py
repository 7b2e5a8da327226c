"""Slots of different K/V shapes sharing pages (page_format.py), and the layouts of the newer
cache rules (layer_groups.py): composite slots, chunked attention, LayerCache, unused slots."""

from __future__ import annotations

import pytest
from mlx_lm.models.cache import ArraysCache, CacheList, ChunkedKVCache, KVCache, RotatingKVCache

from mlxkv.cache.layer_groups import group_layout
from mlxkv.cache.page_format import EMPTY, KEYS, KVShape, PageFormat, pack_kinds

SLIDING = KVShape(1, 256, 1, 256)  # Gemma 4 E2B's sliding layers
GLOBAL = KVShape(1, 512, 1, 512)  # and its full layers: a head twice as wide


def gemma4_like(layers: int = 15, period: int = 5) -> tuple[list, dict]:
    caches = [KVCache() if i % period == period - 1 else RotatingKVCache(512) for i in range(layers)]
    shapes = {i: GLOBAL if i % period == period - 1 else SLIDING for i in range(layers)}
    return caches, shapes


def test_one_shape_is_no_format_and_one_slot_per_page_layer():
    assert pack_kinds([(3, SLIDING), (9, SLIDING)]) == (None, [(3, 1), (3, 1)])
    assert pack_kinds([(3, None), (9, None)]) == (None, [(3, 1), (3, 1)])


def test_a_wider_head_takes_two_unit_heads_and_two_narrow_slots_share_a_page_layer():
    page, cut = pack_kinds([(3, GLOBAL), (12, SLIDING)])
    assert page == PageFormat(2, 256, 2, 256)
    assert page.units(GLOBAL) == (2, 2) and page.units(SLIDING) == (1, 1)
    # The full kind fills 3 page layers; the sliding kind 6, two slots each: groups of 3 page layers.
    assert cut == [(3, 1), (6, 2)]


def test_gemma4_pages_hold_no_idle_unit_head():
    caches, shapes = gemma4_like()
    layout = group_layout(caches, shapes)
    assert layout.page_layers == 3 and not layout.uniform
    for group in layout.groups:
        k_units, v_units = layout.page.units(group.shape)
        used = len(group.slots) * k_units
        assert used == layout.page_layers * layout.page.k_heads, group  # every page layer full
    assert [g.place(j, layout.page) for g in layout.sliding_groups[:1] for j in range(3)] == [
        (0, 0, 0), (0, 1, 1), (1, 0, 0)]
    assert "of k2x256v2x256" in layout.describe() and "sliding512[k1x256v1x256/2]" in layout.describe()


def test_an_indexer_that_keeps_keys_alone_takes_no_value_heads():
    latent, indexer = KVShape(1, 32, 1, 8), KVShape(1, 16, 1, 16, KEYS)
    page, cut = pack_kinds([(4, latent), (4, indexer)])
    assert page == PageFormat(2, 16, 1, 8) and page.units(indexer) == (1, 0)
    assert cut == [(2, 1), (4, 2)]
    empty = KVShape(1, 16, 1, 0, EMPTY)
    assert not empty.stores_values and "v=empty" in empty.describe()


def test_cachelist_parts_get_their_own_rules():
    caches = [CacheList(ArraysCache(2), KVCache()) for _ in range(3)]  # Falcon-H1
    layout = group_layout(caches)
    assert layout.recurrent == ((0, 0), (1, 0), (2, 0)) and layout.state_sizes == (2, 2, 2)
    assert [g.slots for g in layout.groups] == [((0, 1), (1, 1), (2, 1))]
    assert layout.composites == ((0, 2), (1, 2), (2, 2)) and not layout.is_plain
    assert layout.describe() == "pages of 3; full:0.1,1.1,2.1; recurrent:0.0x2,1.0x2,2.0x2"


def test_chunked_attention_is_its_own_rule_and_runs_one_row_at_a_time():
    layout = group_layout([ChunkedKVCache(64), ChunkedKVCache(64), ChunkedKVCache(64), KVCache()])  # Llama 4
    assert [(g.window, g.chunk, g.slots) for g in layout.groups] == [
        (None, None, (3,)), (None, 64, (0,)), (None, 64, (1,)), (None, 64, (2,))]
    assert not layout.batched and layout.full_groups == layout.groups[:1]
    assert "chunked64:0" in layout.describe()


def test_a_layer_cache_is_a_state_slot_of_its_five_arrays():
    class LayerCache:  # deepseek_v41's, by name
        window_size = 128

    layout = group_layout([LayerCache(), LayerCache()])
    assert layout.groups == () and layout.recurrent == (0, 1) and layout.state_sizes == (5, 5)
    assert layout.layer_states == (128, 128) and not layout.batched
    assert layout.describe() == "pages of 0; recurrent:0x5w128,1x5w128"


def test_unused_slots_keep_nothing_and_windows_follow_the_mask():
    caches = [KVCache(), KVCache(), RotatingKVCache(32), KVCache()]
    layout = group_layout(caches, unused=(1,), windows={32: 33})  # nemotron-nas; plamo3's window + 1
    assert layout.unused == (1,) and [g.slots for g in layout.groups] == [(0,), (3,), (2,)]
    assert layout.groups[2].window == 33 and "none:1" in layout.describe()


def test_a_cachelist_inside_a_cachelist_is_named():
    with pytest.raises(Exception, match="a CacheList inside a CacheList"):
        group_layout([CacheList(CacheList(KVCache()))])
