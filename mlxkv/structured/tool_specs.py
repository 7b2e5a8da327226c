"""What every tool-call format's grammar is built from: the tools, and Lark pieces.

tool_grammar.py (and tagged_formats.py) write one grammar per mlx-lm call
format; the tool, the refusal of a tool a format cannot carry, and the Lark
spelling of literals, tags and JSON values are shared here.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from mlxkv.errors import MlxkvError
from mlxkv.structured.grammar import JSON_OPTIONS
from mlxkv.structured.json_strings import without_markers
from mlxkv.structured.tool_refs import deref, lift, reachable, ref_name

ANY_OBJECT = {"type": "object"}
ANNOTATIONS = {"description", "title", "default", "examples", "$comment"}
CALL_NAME = re.compile(r"[^\s<>]+")  # what the XML-style parsers read as a function or parameter name


class UnsupportedTools(MlxkvError):
    """The tools' schemas cannot be written exactly in this call format (the caller leaves
    the tools free)."""


@dataclass(frozen=True)
class ToolSpec:
    name: str
    schema: dict | None  # the arguments' JSON schema; None: any JSON object
    defs: dict = field(default_factory=dict)  # what its refs name, by lifted names (tool_refs.py)


def lifted(tools: list[ToolSpec]) -> list[ToolSpec]:
    """The tools with their refs' targets lifted out of their schemas under names no two tools
    share (tool_refs.py): a format may then nest a schema, or a part of it, anywhere."""
    out = []
    for i, tool in enumerate(tools):
        # json.dumps (in C) finds most tools without a ref faster than a walk would.
        if isinstance(tool.schema, dict) and not tool.defs and '"$ref"' in json.dumps(tool.schema):
            tool = ToolSpec(tool.name, *lift(tool.schema, tool.name, i))
        out.append(tool)
    return out


def properties(tool: ToolSpec, fmt: str, names: re.Pattern = CALL_NAME) -> dict:
    """The tool's properties by name, each name one the format's parser reads back (else UnsupportedTools)."""
    schema = tool.schema
    extra = set(schema) - ANNOTATIONS - {"type", "properties", "required", "additionalProperties", "$schema"}
    if schema.get("type", "object") != "object" or extra:
        raise UnsupportedTools(f"tool {tool.name!r}: only an object schema of properties can be written "
                               f"in the {fmt} format")
    props = schema.get("properties") or {}
    missing = set(schema.get("required") or []) - set(props)
    if missing:
        raise UnsupportedTools(f"tool {tool.name!r}: required {sorted(missing)} are not among its properties")
    for name in props:
        if not names.fullmatch(name):
            raise UnsupportedTools(f"tool {tool.name!r}: parameter {name!r} cannot be written in the {fmt} format")
    return props


def parser_typed(where: str, prop, defs: dict, kinds: tuple[str, ...]):
    """A property the parser converts by its "type" (Qwen3-Coder's, MiniMax's): one that is only a
    $ref has none for it, so it is read as `kinds` (text, or JSON objects and arrays) and
    is written only when what it refers to is of those kinds."""
    if ref_name(prop) is None:
        return prop
    target = deref(prop, defs)
    if not (isinstance(target, dict) and target.get("type") in kinds):
        raise UnsupportedTools(f"{where}: the format's parser reads a parameter that is only a $ref "
                               f"as {' or '.join(kinds)} alone")
    return target


def json_value(schema, markers: tuple[str, ...] = (), defs: dict | None = None) -> str:
    """A JSON value valid against `schema` in Lark (compact), its strings kept from holding any
    of `markers`: the texts where the format's parser would end the call or the argument.
    `defs`: the tools' lifted definitions; those `schema` reaches go to its root."""
    used = reachable(schema, defs) if defs else {}
    if used:
        schema = {**schema, "$defs": {**schema.get("$defs", {}), **used}}
    return f"%json {compact({**without_markers(schema, markers), 'x-guidance': JSON_OPTIONS})}"


def literal(text: str, tags: dict[str, int]) -> str:
    """`text` in Lark: its token where it is one added token, else the string."""
    return f"<[{tags[text]}]>" if text in tags else json.dumps(text)


def spelled(text: str, tags: dict[str, int]) -> str:
    """`text` in Lark, each added-token tag in it written as its token (Kimi-K3's
    `<|open|>tools<|sep|>`: two tokens around a word)."""
    if not text:
        return '""'
    found = [t for t in tags if t in text]
    if not found:
        return json.dumps(text)
    parts = re.split("(" + "|".join(re.escape(t) for t in found) + ")", text)
    return " ".join(f"<[{tags[p]}]>" if p in tags else json.dumps(p) for p in parts if p)


def compact(schema) -> str:
    return json.dumps(schema, separators=(",", ":"))


def regex(text: str) -> str:
    """`text` as a literal inside a Lark /regex/."""
    return re.escape(text).replace("/", "\\/")
