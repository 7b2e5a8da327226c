"""The encoder-output cache: LRU within its byte budget."""

import mlx.core as mx

from mlxkv.vision.encoder_cache import EncoderCache


def test_it_keeps_the_most_recent_entries_within_its_budget():
    cache = EncoderCache(budget_bytes=2 * 400)
    for key in (b"a", b"b"):
        cache.put(key, mx.zeros((100,)))  # 400 bytes each
    assert cache.get(b"a") is not None  # a is now the most recent
    cache.put(b"c", mx.zeros((100,)))
    assert cache.get(b"b") is None and cache.get(b"a") is not None and cache.get(b"c") is not None
    cache.put(b"huge", mx.zeros((1000,)))  # over the whole budget: not kept, nothing evicted for it
    assert cache.stats() == {"entries": 2, "bytes": 800, "budget_bytes": 800, "hits": 3, "misses": 1,
                             "evictions": 1, "image_tokens": 0, "cached_image_tokens": 0}
    cache.count_prompt(12, 8)
    cache.count_prompt(12, 0)
    assert (cache.stats()["image_tokens"], cache.stats()["cached_image_tokens"]) == (24, 8)
