"""`/image PATH` in the chat app: a user message that starts with it carries that image.

The message is stored as typed (no schema change: the path is part of its
text), and becomes image and text parts when the prompt is built, so a
reopened chat sends the same image again and hits its cached blocks (the
image is keyed by its pixels, docs/vision.md). Several `/image` lines may
lead a message; a path with spaces is quoted. The palette's "Attach image"
writes such a line into the message box (`attach_image`).
"""

from __future__ import annotations

import shlex
from pathlib import Path

from mlxkv.errors import MlxkvError

COMMAND = "/image"


def split_images(text: str) -> tuple[list[str], str]:
    """(paths, the rest of the text) of a message whose leading lines are `/image PATH`."""
    paths, lines = [], text.split("\n")
    while lines and lines[0].strip().startswith(COMMAND + " "):
        try:
            args = shlex.split(lines[0].strip()[len(COMMAND):])
        except ValueError:
            break  # an unclosed quote: the line stays text
        if len(args) != 1:
            break
        paths.append(str(Path(args[0]).expanduser()))
        lines.pop(0)
    return paths, "\n".join(lines).strip()


def check_images(text: str) -> None:
    """MlxkvError naming a `/image` path that is not a readable file (before the message is sent)."""
    for path in split_images(text)[0]:
        if not Path(path).is_file():
            raise MlxkvError(f"/image: no such file: {path}")


def attach_image(text: str, typed_path: str) -> str:
    """The message box's `text` with a `/image PATH` line for `typed_path` after its leading
    `/image` lines; MlxkvError when it names no file. The path may come quoted or with escaped
    spaces, as a terminal pastes a dropped file."""
    try:
        args = shlex.split(typed_path)
    except ValueError:
        args = []
    path = args[0] if len(args) == 1 else typed_path.strip()
    if not Path(path).expanduser().is_file():
        raise MlxkvError(f"/image: no such file: {path}")
    path = str(Path(path).expanduser().absolute())  # the chat may be reopened from another directory
    lines = text.split("\n") if text else []
    leading = 0
    while leading < len(lines) and lines[leading].strip().startswith(COMMAND + " "):
        leading += 1
    return "\n".join([*lines[:leading], f"{COMMAND} {shlex.quote(path)}", *lines[leading:]])


def content_parts(text: str):
    """A user message's content: the text alone, or image parts then the text."""
    paths, rest = split_images(text)
    if not paths:
        return text
    return [*({"type": "image", "image": p} for p in paths), {"type": "text", "text": rest}]
