"""Image parts of the three APIs, as the engine takes them: checked here, named in each API's terms.

OpenAI chat `image_url` parts, Anthropic `image` blocks and Responses
`input_image` parts become `{"type": "image", "image": <bytes>, "where":
"messages.0.content.1"}`: the API's own location rides along, so the
backend's decoding and limits (--max-image-pixels, --max-images) name the
part as the client sent it. Only base64 and data: URLs
are read; http(s) URLs are refused (fetching them, behind
--allow-image-urls, is not built yet), and a path is never opened: a
client must not make the server read its files.
"""

from __future__ import annotations

import base64
import binascii

from mlxkv.server.api_errors import ApiError

IMAGE_MEDIA_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp")


def image_from_bytes(data: bytes, where: str) -> dict:
    return {"type": "image", "image": data, "where": where}


def image_from_url(url, where: str, param: str | None = None) -> dict:
    """An OpenAI / Responses image URL: a base64 data: URL."""
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str) or not url:
        raise ApiError(400, f"{where}: an image part needs a url", param=param)
    if url.split(":", 1)[0] in ("http", "https"):
        raise ApiError(400, f"{where}: image URLs are not fetched; send the image as a base64 data: URL",
                       param=param)
    head, _, data = url.partition(",")
    if not head.startswith("data:") or not head.endswith(";base64"):
        raise ApiError(400, f"{where}: an image URL must be a base64 data: URL", param=param)
    return image_from_bytes(_b64(data, where, param), where)


def image_from_source(source, where: str) -> dict:
    """An Anthropic image block's source: {"type": "base64", "media_type": ..., "data": ...}."""
    if not isinstance(source, dict):
        raise ApiError(400, f"{where}.source: an image block needs a source")
    if source.get("type") == "url":
        raise ApiError(400, f"{where}.source: image URLs are not fetched; send the image as base64")
    if source.get("type") != "base64":
        raise ApiError(400, f"{where}.source.type: expected base64, got {source.get('type')!r}")
    if source.get("media_type") not in IMAGE_MEDIA_TYPES:
        raise ApiError(400, f"{where}.source.media_type: expected one of {', '.join(IMAGE_MEDIA_TYPES)}, "
                            f"got {source.get('media_type')!r}")
    return image_from_bytes(_b64(source.get("data"), where, None), where)


def _b64(data, where: str, param: str | None) -> bytes:
    try:
        return base64.b64decode(data or "", validate=True)
    except (binascii.Error, ValueError, TypeError):
        raise ApiError(400, f"{where}: the image is not valid base64", param=param) from None
