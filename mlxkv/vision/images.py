"""Image parts of chat messages: found, decoded and checked, whatever API they came through.

A part is `{"type": "image", "image": X}` with X a path, bytes or a PIL
image (Engine.chat), or a `data:` URL string (what the server's API
parsers hand over). Anything broken or too large is an MlxkvError naming
the part; nothing here reads a URL over the network.
"""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path

from mlxkv.errors import MlxkvError

MAX_IMAGE_PIXELS = 4096 * 4096  # the default of --max-image-pixels
# Qwen's and GLM-4V's processors (smart_resize) raise on a longer side over 200 times the shorter;
# refused here, naming the part, so that sliver is a 400 for every family and never the processor's 500.
MAX_ASPECT_RATIO = 200
IMAGE_TYPES = ("image", "image_url", "input_image")


def is_image_part(part) -> bool:
    return isinstance(part, dict) and part.get("type") in IMAGE_TYPES


def has_images(messages) -> bool:
    """Whether chat `messages` hold an image part (malformed messages: no; the chat check names them)."""
    if not isinstance(messages, list):
        return False
    return any(is_image_part(p) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list)
               for p in m["content"])


def image_parts(messages: list[dict]) -> list[tuple[str, dict]]:
    """(where, part) of every image part, in prompt order; where is the part's own (an API's
    location, server/image_parts.py), else 'messages.I.content.J'."""
    return [(part.get("where") or f"messages.{i}.content.{j}", part) for i, m in enumerate(messages)
            if isinstance(m.get("content"), list) for j, part in enumerate(m["content"]) if is_image_part(part)]


def _source(part: dict):
    if part.get("type") == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    return part.get("image", part.get("image_url"))


def load_image(part: dict, where: str, max_pixels: int = MAX_IMAGE_PIXELS):
    """The part's image as RGB PIL; MlxkvError naming `where` when it is not one we take."""
    from PIL import Image, UnidentifiedImageError

    source = _source(part)
    try:
        if isinstance(source, Image.Image):
            image = source
        elif isinstance(source, (bytes, bytearray)):
            image = Image.open(io.BytesIO(source))
        elif isinstance(source, str) and source.startswith("data:"):
            image = Image.open(io.BytesIO(_data_url_bytes(source, where)))
        elif isinstance(source, str) and source.split(":", 1)[0] in ("http", "https"):
            raise MlxkvError(f"{where}: image URLs are not fetched (send a data: URL or base64)")
        elif isinstance(source, (str, Path)):
            image = _open_path(Path(source), where)
        else:
            raise MlxkvError(f"{where}: an image part needs a path, bytes, a PIL image or a data: URL")
        if image.width * image.height > max_pixels:
            raise MlxkvError(f"{where}: the image has {image.width}x{image.height} pixels, "
                             f"more than the limit of {max_pixels}")
        if max(image.size) > MAX_ASPECT_RATIO * min(image.size):
            raise MlxkvError(f"{where}: the image is {image.width}x{image.height} pixels, one side more than "
                             f"{MAX_ASPECT_RATIO} times the other")
        image.load()
        return image.convert("RGB")
    except Image.DecompressionBombError:  # PIL refuses to open it: its header's size is past PIL's own cap
        cap = 2 * Image.MAX_IMAGE_PIXELS
        limit = f"the limit of {max_pixels}" if max_pixels < cap else "the most Pillow will decode"
        raise MlxkvError(f"{where}: the image has more than {cap} pixels, more than {limit}") from None
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise MlxkvError(f"{where}: not an image we can read ({type(e).__name__})") from None


def _open_path(path: Path, where: str):
    """A path (Engine.chat's, never a client's): a missing or unreadable file is named, as a user typed it."""
    from PIL import Image

    try:
        return Image.open(path)
    except (FileNotFoundError, IsADirectoryError, PermissionError) as e:
        raise MlxkvError(f"{where}: cannot open {str(path)!r}: {(e.strerror or type(e).__name__).lower()}") from None


def _data_url_bytes(url: str, where: str) -> bytes:
    head, _, data = url.partition(",")
    if not head.endswith(";base64"):
        raise MlxkvError(f"{where}: a data: URL must be base64")
    try:
        return base64.b64decode("".join(data.split()), validate=True)  # line breaks of a wrapped encoding
    except (binascii.Error, ValueError):
        raise MlxkvError(f"{where}: the data: URL is not valid base64") from None
