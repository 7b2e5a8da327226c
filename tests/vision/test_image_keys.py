"""Image identity in the block keys: only the blocks an image overlaps carry it."""

import subprocess
import sys

import numpy as np
import pytest

from mlxkv.cache.hashing import extend_block_hashes, root_hash
from mlxkv.vision.image_keys import ImageSpan, block_extras, image_hash, keyed_root

BS = 4
ROOT = root_hash(b"model")


def _hashes(tokens, spans):
    return extend_block_hashes([], keyed_root(ROOT, spans, BS), tokens, BS)


def test_only_blocks_an_image_overlaps_change_and_later_ones_follow_the_chain():
    tokens = list(range(20))  # blocks 0..4; the image is tokens 6..9 (blocks 1, 2)
    a, b = image_hash(np.zeros((4, 3))), image_hash(np.ones((4, 3)))
    with_a = _hashes(tokens, [ImageSpan(6, 4, a)])
    with_b = _hashes(tokens, [ImageSpan(6, 4, b)])
    text = extend_block_hashes([], ROOT, tokens, BS)
    assert with_a[0] == with_b[0] == text[0]  # the text before the image is shared
    assert all(x != y for x, y in zip(with_a[1:], with_b[1:]))  # the image's blocks and all after
    assert all(x != y for x, y in zip(with_a[1:], text[1:]))
    assert _hashes(tokens, [ImageSpan(6, 4, a)]) == with_a


def test_the_offset_of_an_image_in_its_block_is_part_of_the_key():
    a = image_hash(np.zeros((4, 3)))
    assert block_extras([ImageSpan(5, 2, a)], BS) != block_extras([ImageSpan(6, 2, a)], BS)
    assert set(block_extras([ImageSpan(3, 6, a)], BS)) == {0, 1, 2}


def test_image_hash_is_the_pixels_grid_and_settings_not_a_name():
    pixels = np.arange(12, dtype=np.float32).reshape(4, 3)
    h = image_hash(pixels, np.array([[1, 2, 2]]), {"max_pixels": 100})
    assert h == image_hash(pixels.copy(), np.array([[1, 2, 2]]), {"max_pixels": 100})
    assert h != image_hash(pixels.reshape(3, 4), np.array([[1, 2, 2]]), {"max_pixels": 100})
    assert h != image_hash(pixels, np.array([[1, 1, 4]]), {"max_pixels": 100})
    assert h != image_hash(pixels, np.array([[1, 2, 2]]), {"max_pixels": 200})
    assert h != image_hash(pixels.astype(np.float16), np.array([[1, 2, 2]]), {"max_pixels": 100})
    assert len(h) == 32  # the full SHA-256, never cut short


@pytest.mark.slow  # starts a Python process
def test_image_hash_is_the_same_in_another_process():
    code = ("import numpy as np; from mlxkv.vision.image_keys import image_hash; "
            "print(image_hash(np.arange(6.0).reshape(2, 3), np.array([1, 2]), {'a': 1}).hex())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other == image_hash(np.arange(6.0).reshape(2, 3), np.array([1, 2]), {"a": 1}).hex()
