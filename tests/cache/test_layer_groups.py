"""Layer groups from a model's caches, and the sliding-window rule's arithmetic."""

from __future__ import annotations

import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from mlxkv.cache.layer_groups import FULL, SLIDING, GroupLayout, KVGroup, group_layout
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
    assert [g.kind for g in layout.groups] == [FULL] + [SLIDING] * 6
    assert layout.groups[0].slots == (5, 11, 17, 23)
    sliding = [s for g in layout.sliding_groups for s in g.slots]
    assert sorted(sliding) == [i for i in range(26) if i % 6 != 5]
    assert max(len(g.slots) for g in layout.groups) == 4 and len(layout.groups[-1].slots) == 2
    assert all(g.window == 512 for g in layout.sliding_groups)
    assert layout.place(17) == (layout.groups[0], 2)
    assert layout.describe().startswith("pages of 4; full:5,11,17,23; sliding512:0,1,2,3")


def test_windows_of_two_sizes_are_two_kinds():
    layout = group_layout([RotatingKVCache(64), KVCache(), RotatingKVCache(128), RotatingKVCache(64)])
    assert [(g.kind, g.window, g.slots) for g in layout.groups] == [
        (FULL, None, (1,)), (SLIDING, 64, (0,)), (SLIDING, 64, (3,)), (SLIDING, 128, (2,))]


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


def test_a_model_of_recurrent_layers_alone_is_refused():
    with pytest.raises(MlxkvError, match="only recurrent state"):
        group_layout([ArraysCache(2), ArraysCache(2)])


@pytest.mark.parametrize(("window", "position", "first_block", "first_visible"), [
    (32, 0, 0, 0), (32, 31, 0, 0), (32, 32, 0, 1), (32, 47, 1, 16), (32, 48, 1, 17),
    (8, 20, 0, 13), (8, 24, 1, 17),   # a window shorter than a block
    (16, 16, 0, 1), (16, 31, 1, 16),  # a window of exactly one block
])
def test_a_sliding_window_needs_the_blocks_of_its_last_window_positions(window, position, first_block, first_visible):
    group = KVGroup(1, SLIDING, window, (0,))
    assert group.first_needed_block(position, 16) == first_block
    assert group.first_visible(position) == first_visible
    # The query at `position` sees exactly `window` positions, itself included.
    assert position - group.first_visible(position) + 1 == min(window, position + 1)


def test_a_full_group_needs_every_block():
    group = KVGroup(0, FULL, None, (0,))
    assert group.first_needed_block(10_000, 16) == 0 and group.first_visible(10_000) == 0
