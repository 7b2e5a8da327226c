"""Image parts of the three APIs, as the engine takes them: checked here, named in each API's terms.

OpenAI chat `image_url` parts, Anthropic `image` blocks and Responses
`input_image` parts become `{"type": "image", "image": <bytes>, "where":
"messages.0.content.1"}`: the API's own location rides along, so the
backend's decoding and limits (--max-image-pixels, --max-images) name the
part as the client sent it. Only base64 and data: URLs are read here;
http(s) URLs are fetched by the backend, on a worker thread, only behind
--allow-image-urls (off by default: a client could otherwise make the
server reach hosts it can see). A path is never opened: a client must not
make the server read its files.
"""

from __future__ import annotations

import base64
import binascii

from mlxkv.server.api_errors import ApiError

IMAGE_MEDIA_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp")


def image_usage(stats) -> dict:
    """A usage object's image fields: the prompt's image tokens and how many of them were cached
    (mlxkv's own, beside each API's cached count; none for a prompt without images)."""
    if not getattr(stats, "image_tokens", 0):
        return {}
    return {"image_tokens": stats.image_tokens, "cached_image_tokens": stats.cached_image_tokens}


def image_from_bytes(data: bytes, where: str) -> dict:
    return {"type": "image", "image": data, "where": where}


def image_from_url(url, where: str, param: str | None = None) -> dict:
    """An OpenAI / Responses image URL: a base64 data: URL."""
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str) or not url:
        raise ApiError(400, f"{where}: an image part needs a url", param=param)
    if url.split(":", 1)[0] in ("http", "https"):
        return {"type": "image", "url": url, "where": where}  # fetched by the backend, if allowed
    head, _, data = url.partition(",")
    if not head.startswith("data:") or not head.endswith(";base64"):
        raise ApiError(400, f"{where}: an image URL must be a base64 data: URL", param=param)
    return image_from_bytes(_b64(data, where, param), where)


def image_from_source(source, where: str) -> dict:
    """An Anthropic image block's source: {"type": "base64", "media_type": ..., "data": ...}."""
    if not isinstance(source, dict):
        raise ApiError(400, f"{where}.source: an image block needs a source")
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return {"type": "image", "url": source["url"], "where": where}
    if source.get("type") != "base64":
        raise ApiError(400, f"{where}.source.type: expected base64, got {source.get('type')!r}")
    if source.get("media_type") not in IMAGE_MEDIA_TYPES:
        raise ApiError(400, f"{where}.source.media_type: expected one of {', '.join(IMAGE_MEDIA_TYPES)}, "
                            f"got {source.get('media_type')!r}")
    return image_from_bytes(_b64(source.get("data"), where, None), where)


def _b64(data, where: str, param: str | None) -> bytes:
    """Strict base64, but for line breaks: Python's base64.encodebytes and GNU base64 wrap at 76."""
    try:
        return base64.b64decode("".join(data.split()) if isinstance(data, str) else data or "", validate=True)
    except (binascii.Error, ValueError, TypeError):
        raise ApiError(400, f"{where}: the image is not valid base64", param=param) from None


FETCH_TIMEOUT_S = 20


def fetch_image_urls(messages: list[dict], allowed: bool, max_bytes: int) -> None:
    """Replace each image part's `url` by the bytes it names (blocking: a worker thread's job)."""
    import urllib.request

    for m in messages:
        for part in m.get("content") if isinstance(m.get("content"), list) else ():
            url = part.get("url") if isinstance(part, dict) and part.get("type") == "image" else None
            if url is None:
                continue
            where = part.get("where", "messages")
            if not allowed:
                raise ApiError(400, f"{where}: image URLs are off on this server (it starts with --allow-image-urls "
                                    f"to fetch them); send the image as base64")
            try:
                with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as response:
                    data = response.read(max_bytes + 1)
            except (OSError, ValueError) as e:
                raise ApiError(400, f"{where}: could not fetch the image: {e}") from None
            if len(data) > max_bytes:
                raise ApiError(400, f"{where}: the image at the URL is larger than {max_bytes} bytes")
            part["image"] = data
            del part["url"]
