"""Layer groups from a model's caches (the rules' arithmetic: tests/cache/groups/)."""

from __future__ import annotations

import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from mlxkv.cache.layer_groups import GroupLayout, group_layout
from mlxkv.errors import MlxkvError


def gemma3_like(layers: int, pattern: int = 6, window: int = 512) -> list:
    return [KVCache() if i % pattern == pattern - 1 else RotatingKVCache(window) for i in range(layers)]


def test_a_plain_model_is_one_full_group_of_every_layer():
    layout = group_layout([KVCache() for _ in range(5)])
    assert layout == GroupLayout.plain(5) and layout.is_plain
    assert layout.page_layers == 5 and layout.groups[0].slots == (0, 1, 2, 3, 4)


def test_gemma3_groups_by_rule_in_pages_of_the_smallest_kind():
    layout = group_layout(gemma3_like(26))  # Gemma 3 1B: 4 full layers, 22 sliding
    assert layout.page_layers == 4
    assert [g.window for g in layout.groups] == [None] + [512] * 6
    assert layout.groups[0].slots == (5, 11, 17, 23)
    sliding = [s for g in layout.sliding_groups for s in g.slots]
    assert sorted(sliding) == [i for i in range(26) if i % 6 != 5]
    assert max(len(g.slots) for g in layout.groups) == 4 and len(layout.groups[-1].slots) == 2
    assert all(g.window == 512 for g in layout.sliding_groups)
    assert layout.place(17) == (layout.groups[0], 2)
    assert layout.describe().startswith("pages of 4; full:5,11,17,23; sliding512:0,1,2,3")


def test_windows_of_two_sizes_are_two_kinds():
    layout = group_layout([RotatingKVCache(64), KVCache(), RotatingKVCache(128), RotatingKVCache(64)])
    assert [(g.window, g.slots) for g in layout.groups] == [(None, (1,)), (64, (0,)), (64, (3,)), (128, (2,))]


def test_a_cache_mlxkv_cannot_page_is_named():
    with pytest.raises(MlxkvError, match="keeps its first 4 tokens"):
        group_layout([KVCache(), RotatingKVCache(64, keep=4)])


def test_recurrent_slots_take_no_pages():
    layout = group_layout([ArraysCache(2), KVCache(), ArraysCache(1), KVCache(), RotatingKVCache(32)])
    assert layout.recurrent == (0, 2) and layout.state_sizes == (2, 1) and layout.has_recurrent
    assert [g.slots for g in layout.groups] == [(1,), (3,), (4,)] and layout.page_layers == 1
    assert not layout.is_plain and "recurrent:0x2,2x1" in layout.describe()
    # All attention and full: still not plain, so the fingerprint says it has state.
    assert not group_layout([ArraysCache(2), KVCache()]).is_plain


def test_a_model_of_state_slots_alone_has_no_attention_groups():
    layout = group_layout([ArraysCache(2), ArraysCache(2)])
    assert layout.groups == () and layout.page_layers == 0 and layout.recurrent == (0, 1)
    assert layout.describe() == "pages of 0; recurrent:0x2,1x2"


def test_a_model_that_keeps_no_cache_is_refused():
    with pytest.raises(MlxkvError, match="keeps no cache"):
        group_layout([])
