"""Tool calls as a grammar, in the model's own call format.

mlx-lm's tokenizer names the strings that open and close a model's tool
call, and its parser reads what is between them (server/tool_calls.py);
those stay the format of record. For the JSON-body format (mlx-lm's
`json_tools` parser: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
Qwen's and Hermes' models) the grammar writes exactly what that parser
reads: the opening marker, a JSON object whose "name" is one of the tools
and whose "arguments" match that tool's schema, the closing marker.

- `required` (or one named tool): the reply is one call.
- `auto`: the reply is text without the opening marker, or such text
  followed by one call: the model chooses, and a call it starts is a valid one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from mlxkv.errors import MlxkvError
from mlxkv.structured.grammar import JSON_OPTIONS, Grammar

ANY_OBJECT = {"type": "object"}
# mlx-lm's parsers whose call body is JSON {"name", "arguments"} between the markers.
JSON_BODY_PARSERS = ("json_tools",)


@dataclass(frozen=True)
class ToolSpec:
    name: str
    schema: dict | None  # the arguments' JSON schema; None: any JSON object


def tool_call_grammar(start: str, end: str, tools: list[ToolSpec], allow_text: bool,
                      token_ids: tuple[int | None, int | None] = (None, None)) -> Grammar:
    """The Lark grammar of one call to one of `tools` between `start` and `end` (with
    `allow_text`: or of text, then maybe such a call).

    `token_ids`: the markers' ids where each is one added token of the tokenizer (Qwen's
    <tool_call>). llguidance keeps added tokens apart from text, so such a marker is written
    as its token (`<[id]>`): as text it could only be spelled out byte by byte, which the
    model never does."""
    if not tools:
        raise MlxkvError("a tool-call grammar needs at least one tool")
    body = f"body: %json {json.dumps(_body_schema(tools), separators=(',', ':'))}"
    open_id, close_id = token_ids
    close = json.dumps(end) if close_id is None else f"<[{close_id}]>"
    if open_id is not None:  # a token, never text: text cannot run into it
        opening = f"<[{open_id}]>"
        if not allow_text:
            return Grammar.lark(f"start: {opening} body {close}\n{body}\n")
        return Grammar.lark(f"start: TEXT? ({opening} body {close})?\nTEXT: /(.|\\n)+/\n{body}\n")
    if not allow_text:
        return Grammar.lark(f"start: {json.dumps(start)} body {close}\n{body}\n")
    marker = _regex(start)
    return Grammar.lark(
        f"start: TEXT | CALL_OPEN body {close}\n"
        f"TEXT: /(.|\\n)*/ & ~/(.|\\n)*{marker}(.|\\n)*/\n"
        # Text up to the first marker, the marker included, as one lexeme: the lexer need not guess
        # where the text ends (a text lexeme that stopped before "<tool_call" could not go on).
        f"CALL_OPEN: /(.|\\n)*{marker}/ & ~/(.|\\n)*{marker}(.|\\n)+/\n"
        f"{body}\n")


def _body_schema(tools: list[ToolSpec]) -> dict:
    calls = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.schema or ANY_OBJECT},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {**schema, "x-guidance": JSON_OPTIONS}


def _regex(text: str) -> str:
    """`text` as a literal inside a Lark /regex/."""
    return re.escape(text).replace("/", "\\/")
