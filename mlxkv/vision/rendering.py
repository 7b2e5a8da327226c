"""A family's chat messages as its template takes them: where its images' placeholders are written.

Most families' chat templates take image parts (`{"type": "image"}`) and write the image's
placeholder themselves. Some families' processors take string content with the image token
already in the text, and expand that token by the image's size; mlx-vlm's prompt_utils writes
it for them, and so must mlxkv, or the processor finds no placeholder to expand. Molmo's
template takes text alone (its processor adds the image's tokens before it). Chosen per family
(mlx-vlm's model type), as mlx-vlm's prompt_utils chooses them (mlx-vlm 0.7.10).
"""

from __future__ import annotations

import re

from mlxkv.errors import MlxkvError
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
    """The prompt text of chat `messages` for `family`'s processor; MlxkvError naming an image part this
    family's prompt has no place for, or when its image token is not in the text once an image."""
    _refuse_images_outside_user_messages(family, messages)
    text = compat.render_chat(processor, template_messages(family, messages))
    _check_image_tokens(family, text, sum(1 for m in messages if isinstance(m.get("content"), list)
                                          for p in m["content"] if is_image_part(p)))
    return text


def _writes_image_tokens(family: str) -> bool:
    """True when mlxkv writes the family's images into string content (its template takes no image parts)."""
    return family in IMAGE_TOKENS or family in FIRST_IMAGE_ONLY or family in NUMBERED + TEXT_ONLY


def _refuse_images_outside_user_messages(family: str, messages: list[dict]) -> None:
    """Only a user message's images are written where they stand; any other's would be dropped from the text
    while its processor still embeds the image where it finds a token (MiniCPM-o's: at the prompt's start)."""
    if not _writes_image_tokens(family):
        return  # its own template places (or leaves out: a 400 by span count) every image part
    for i, m in enumerate(messages):
        if m.get("role") != "user" and isinstance(m.get("content"), list):
            for j, part in enumerate(m["content"]):
                if is_image_part(part):
                    where = part.get("where") or f"messages.{i}.content.{j}"
                    raise MlxkvError(f"{where}: an image in a message of role {m.get('role')!r}; "
                                     f"{family} takes images in user messages only")


def _check_image_tokens(family: str, text: str, images: int) -> None:
    """The processor puts images at their tokens in the text: a token also in a system prompt, a tool's output
    or the user's own text would take an image's place, so each image's token must be there once."""
    if family in IMAGE_TOKENS:
        found = text.count(IMAGE_TOKENS[family].strip())
    elif family in NUMBERED:
        found = len(re.findall(r"<\|image_\d+\|>", text))
    else:
        return  # its template writes the tokens (span count), one a message, or none (Molmo)
    if found != images:
        raise MlxkvError(f"messages: {family}'s image token is in the prompt {found} times for {images} images "
                         f"(is it in a message's text?)")


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

