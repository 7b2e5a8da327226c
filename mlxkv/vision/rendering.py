"""A family's chat messages as its template takes them: where its images' placeholders are written.

Most families' chat templates take image parts (`{"type": "image"}`) and write the image's
placeholder themselves. Some families' processors take string content with the image token
already in the text, and expand that token by the image's size; mlx-vlm's prompt_utils writes
it for them, and so must mlxkv, or the processor finds no placeholder to expand. Molmo's
template takes text alone (its processor adds the image's tokens before it). Chosen per family
(mlx-vlm's model type), as mlx-vlm's prompt_utils chooses them (mlx-vlm 0.7.10).
"""

from __future__ import annotations

from mlxkv.vision import compat
from mlxkv.vision.images import is_image_part

# family -> the text an image part becomes in its user message
IMAGE_TOKENS = {"minicpmo": "<image>", "llmjpvl": "<image>", "jina_vlm": "<|image|>",
                "step3p7": "<im_patch>", "deepseek_vl_v2": "<image>\n", "deepseekocr": "<image>\n"}
# (keyed by its config's model type) a message's first image is marked, later ones not
FIRST_IMAGE_ONLY = {"unlimited-ocr": "<image>"}
NUMBERED = ("phi3_v",)  # image k of a message (from 1) is `<|image_k|>`
TEXT_ONLY = ("molmo",)


def render(processor, family: str, messages: list[dict]) -> str:
    """The prompt text of chat `messages` for `family`'s processor."""
    return compat.render_chat(processor, template_messages(family, messages))


def template_messages(family: str, messages: list[dict]) -> list[dict]:
    """`messages` as `family`'s chat template takes them."""
    return [{**m, "content": _content(family, m)} for m in messages]


def _content(family: str, message: dict):
    content = message.get("content")
    if not isinstance(content, list):
        return content
    if family not in IMAGE_TOKENS and family not in FIRST_IMAGE_ONLY and family not in NUMBERED + TEXT_ONLY:
        return [{"type": "image"} if is_image_part(p) else p for p in content]  # its template writes them
    if family in TEXT_ONLY or message.get("role") != "user" or not any(is_image_part(p) for p in content):
        return _text(content)
    out, k = [], 0
    for part in content:  # text and image tokens in order, unspaced (mlx-vlm's _format_with_token)
        if is_image_part(part):
            out.append(_image_token(family, k))
            k += 1
        elif part.get("text"):
            out.append(part["text"])
    return "".join(out)


def _image_token(family: str, k: int) -> str:
    if family in NUMBERED:
        return f"<|image_{k + 1}|>"
    if family in FIRST_IMAGE_ONLY:
        return FIRST_IMAGE_ONLY[family] if k == 0 else ""
    return IMAGE_TOKENS[family]


def _text(content: list) -> str:
    """A message's text parts, spaced (its images are written by no one: text-only roles and families)."""
    return " ".join(p["text"] for p in content if isinstance(p, dict) and p.get("text")).strip()

