"""The rope-delta cache and when a row's inputs are made again (vision/rope_deltas.py, vision/model.py)."""

import mlx.core as mx

from mlxkv.vision.model import RowInputs, VisionRows
from mlxkv.vision.rope_deltas import RopeDeltas, prefix_key


def test_the_key_is_the_tokens_through_the_last_image_and_the_grids():
    tokens = [1, 2, 3, 9, 9, 4, 5]
    key = prefix_key(tokens, 5, [[1, 2, 2]])
    assert key == prefix_key(tokens[:5] + [7, 7, 7], 5, [[1, 2, 2]])  # the text after the images: no matter
    assert key != prefix_key(tokens, 5, [[1, 2, 4]]) and key != prefix_key([0, *tokens[1:]], 5, [[1, 2, 2]])
    deltas = RopeDeltas(max_entries=2)
    for k, d in ((b"a", -3), (b"b", -4), (b"c", -5)):
        deltas.put(k, d)
    assert (deltas.get(b"a"), deltas.get(b"c"), len(deltas)) == (None, -5, 2)


class _Request:
    request_id = 7


def test_a_row_is_made_again_only_when_its_hit_is_now_short_of_what_its_inputs_serve():
    made = []

    def make(computed, first):
        made.append((computed, first))
        return RowInputs(mx.zeros((0, 4)), mx.zeros((3, 0)), -2, from_position=40)  # past the last image

    rows, request = VisionRows(), _Request()
    rows.attach(request, make)
    for computed in (48, 52, 12, 60):  # a preemption, its blocks evicted: resumed at 12, inside an image
        rows.get(7, computed)
    assert made == [(48, True), (12, False)]
