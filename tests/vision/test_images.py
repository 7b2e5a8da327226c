"""Image parts: decoded, limited, and a bad one named in one line."""

import base64
import io

import pytest
from vision_cases import make_image

from mlxkv.errors import MlxkvError
from mlxkv.vision.images import has_images, image_parts, load_image


def _png(image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_a_path_bytes_a_pil_image_and_a_data_url_give_the_same_pixels(tmp_path):
    image = make_image()
    (tmp_path / "a.png").write_bytes(_png(image))
    parts = [{"type": "image", "image": str(tmp_path / "a.png")}, {"type": "image", "image": _png(image)},
             {"type": "image", "image": image}, {"type": "image_url", "image_url": {"url": _data_url(_png(image))}},
             {"type": "image", "image": "data:image/png;base64," + base64.encodebytes(_png(image)).decode()}]
    loaded = [load_image(p, "p").tobytes() for p in parts]
    assert loaded == [image.tobytes()] * 5


@pytest.mark.parametrize("part, says", [
    ({"type": "image", "image": b"not a png"}, "not an image we can read"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "not valid base64"),
    ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "not fetched"),
    ({"type": "image", "image": 42}, "needs a path, bytes"),
    ({"type": "image", "image": "/no/such/cat.png"}, "cannot open '/no/such/cat.png': no such file"),
])
def test_a_bad_image_part_is_one_line_naming_it(part, says):
    with pytest.raises(MlxkvError, match=f"messages.0.content.1: .*{says}"):
        load_image(part, "messages.0.content.1")


def test_a_sliver_image_is_refused_naming_it():
    """Qwen2-VL's processor raised on it, a 500 (tried: 2000x1 through the server); 1x200 still loads."""
    assert load_image({"type": "image", "image": make_image(1, 200)}, "m").size == (1, 200)
    for w, h in [(1, 201), (402, 2)]:
        with pytest.raises(MlxkvError, match=f"m: the image is {w}x{h} pixels, one side more than 200"):
            load_image({"type": "image", "image": make_image(w, h)}, "m")


def test_a_png_whose_header_claims_a_huge_size_is_refused_as_too_large():
    """PIL will not open it (DecompressionBombError); it was 'not an image we can read'."""
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = chunk(b"IHDR", struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0))
    png = b"\x89PNG\r\n\x1a\n" + header + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")
    with pytest.raises(MlxkvError, match=r"m: the image has more than \d+ pixels, more than the limit of 1000"):
        load_image({"type": "image", "image": png}, "m", max_pixels=1000)
    # A limit past what Pillow decodes is not quoted as the limit the image broke.
    with pytest.raises(MlxkvError, match=r"m: the image has more than \d+ pixels, more than the most Pillow will"):
        load_image({"type": "image", "image": png}, "m", max_pixels=10**12)


def test_an_image_over_the_pixel_limit_is_refused():
    with pytest.raises(MlxkvError, match="112x84 pixels, more than the limit of 1000"):
        load_image({"type": "image", "image": make_image()}, "m", max_pixels=1000)


def test_image_parts_are_found_in_prompt_order():
    messages = [{"role": "system", "content": "hi"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image", "image": b""}]},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]
    assert [w for w, _ in image_parts(messages)] == ["messages.1.content.1", "messages.2.content.0"]
    assert has_images(messages) and not has_images(messages[:1]) and not has_images("hi")
