"""A Responses API request's `instructions`, `input` items and `tools` as
chat messages and tools, the form chat templates take.

Items: messages (`input_text` / `output_text` parts; a developer message is
a system message), `function_call` and `function_call_output` (a tool call
and its result), `reasoning` (accepted, never rendered: the model does not
see earlier reasoning again). Codex's freeform tools come as
`custom_tool_call` / `custom_tool_call_output`, rendered as function calls.
Tools: `function` tools, and the functions inside a `namespace`; built-in
tool types (web_search, ...) cannot run here and are left out, with a note.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from mlxkv.server.api_errors import ApiError
from mlxkv.server.image_parts import image_from_url

log = logging.getLogger(__name__)

TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
SKIPPED_ITEMS = ("reasoning", "item_reference", "compaction")


def input_messages(instructions: str | None, items: str | list[dict]) -> tuple[list[dict], list[dict]]:
    """(the system message from `instructions`, if any; the messages of `items`)."""
    system = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return system, [{"role": "user", "content": items}]
    out: list[dict] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ApiError(400, f"input.{i}: an input item is an object, got {type(item).__name__}", param="input")
        _add_item(out, item, f"input.{i}")
    return system, out


def _add_item(out: list[dict], item: dict, where: str) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise ApiError(400, f"{where}.role: expected user, assistant, system or developer, got {role!r}",
                           param="input")
        out.append({"role": "system" if role == "developer" else role,
                    "content": _text(item.get("content"), f"{where}.content")})
    elif kind in ("function_call", "custom_tool_call"):
        arguments = item.get("arguments") if kind == "function_call" else item.get("input")
        call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": _arguments(arguments)}}
        if out and out[-1]["role"] == "assistant":  # calls of one turn stay one assistant message
            out[-1].setdefault("tool_calls", []).append(call)
        else:
            out.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind in ("function_call_output", "custom_tool_call_output"):
        out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                    "content": _text(item.get("output"), f"{where}.output")})
    elif kind in SKIPPED_ITEMS:
        return
    else:
        log.info("left out an input item of type %r: it has no form in a chat template", kind)


def _text(content: Any, where: str) -> str | list[dict]:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ApiError(400, f"{where}: expected text or a list of text parts", param="input")
    kinds = [p.get("type") if isinstance(p, dict) else None for p in content]
    for j, kind in enumerate(kinds):  # every part checked first: none is dropped beside an image
        if kind not in TEXT_PARTS and kind != "input_image":
            raise ApiError(400, f"{where}.{j}: {kind!r} parts are not supported (text and input_image are)",
                           param="input")
    texts = [_part_text(p, f"{where}.{j}") if kind != "input_image" else None
             for j, (p, kind) in enumerate(zip(content, kinds))]
    if "input_image" in kinds:  # text and images, in order
        return [_image(p, f"{where}.{j}") if text is None
                else {"type": "text", "text": text} for j, (p, text) in enumerate(zip(content, texts))]
    return "".join(texts)


def _part_text(part: dict, where: str) -> str:
    text = part.get("text") or part.get("refusal") or ""
    if not isinstance(text, str):
        raise ApiError(400, f"{where}.text: expected a string, got {type(text).__name__}", param="input")
    return text


def _image(part: dict, where: str) -> dict:
    if part.get("image_url") is None and part.get("file_id"):  # the Files API is not served
        raise ApiError(400, f"{where}: a file_id image is not supported here; send image_url as a data: URL",
                       param="input")
    return image_from_url(part.get("image_url"), where, "input")


def _arguments(arguments: Any) -> Any:
    """A call's arguments as an object where they are JSON text (templates apply tojson)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments or {}


def template_tools(tools: list[dict] | None, tool_choice: Any) -> list[dict] | None:
    """Function tools (namespaces flattened) as chat templates take them; None when there are none."""
    if not tools or tool_choice == "none":
        return None
    out, skipped = [], []
    for tool in tools:
        kind = tool.get("type")
        if kind == "function":
            out.append(_function(tool))
        elif kind == "namespace":
            out += [_function(t) for t in tool.get("tools") or [] if t.get("type", "function") == "function"]
        else:
            skipped.append(kind)
    if skipped:
        log.debug("left out built-in tools this server cannot run: %s", ", ".join(sorted(map(str, set(skipped)))))
    return out or None


def _function(tool: dict) -> dict:
    if not tool.get("name"):
        raise ApiError(400, "tools: a function tool needs a name", param="tools")
    return {"type": "function", "function": {"name": tool["name"], "description": tool.get("description") or "",
                                              "parameters": tool.get("parameters") or {"type": "object"}}}
