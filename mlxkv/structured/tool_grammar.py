"""Tool calls as a grammar, in the model's own call format.

mlx-lm's tokenizer names the strings that open and close a model's tool
call, and its parser (mlx_lm.tool_parsers.<name>) reads what is between
them (server/tool_calls.py); those stay the format of record. For each
format below the grammar writes exactly what that parser reads: the
opening marker, a call to one of the tools whose arguments match that
tool's schema as the parser converts them, the closing marker.

- `json_tools` (Qwen's and Hermes' models): `{"name": ..., "arguments": {...}}`.
- `qwen3_coder`: `<function=name>` then one `<parameter=p>value</parameter>`
  per argument, the value's text converted by the parser per the type the
  schema gives the property (string, integer, number, boolean, object,
  array).
- `glm47`: `name<arg_key>k</arg_key><arg_value>v</arg_value>...`, a string
  property's value its text (stripped by the parser: no edge whitespace),
  any other's JSON valid against the property's schema.
- `pythonic` (LFM2's): `[name(k=value, ...)]`, each value JSON.
- `kimi_k2`: a section of `functions.name:i` + JSON arguments calls.

Inner tags a tokenizer holds as added tokens (GLM's, Kimi's) are written as
their tokens, as the markers are.

The newer formats (minimax_m2, minicpm5, muse_spark, kimi_k3, gemma4,
function_gemma, mistral) are in tagged_formats.py; `longcat` is GLM's under
its own tag names.

A tool the format's parser cannot read back exactly (a string pattern or
bounds where the value is raw text, a name with spaces) raises
UnsupportedTools. A JSON value (json_tools' body, an object or array
argument) is kept from holding its format's closing text inside a string
(json_strings.py), as raw text values are by their terminals.

- `required` (or one named tool): the reply is one call, or with
  `parallel` one or more, a newline apart (in one section where the format
  has sections: SECTIONED).
- `auto`: the reply is text without the opening marker, or such text
  followed by such calls: the model chooses, and a call it starts is a valid one.
"""

from __future__ import annotations

import json
import re

from mlxkv.errors import MlxkvError
from mlxkv.structured import tagged_formats
from mlxkv.structured.grammar import Grammar
from mlxkv.structured.tool_specs import ANNOTATIONS as _XML_ANNOTATIONS
from mlxkv.structured.tool_specs import ANY_OBJECT, ToolSpec, UnsupportedTools  # noqa: F401 (the callers' names)
from mlxkv.structured.tool_specs import CALL_NAME as _XML_NAME
from mlxkv.structured.tool_specs import compact as _compact
from mlxkv.structured.tool_specs import json_value, lifted, parser_typed
from mlxkv.structured.tool_specs import literal as _literal
from mlxkv.structured.tool_specs import properties as _properties
from mlxkv.structured.tool_specs import regex as _regex
from mlxkv.structured.tool_specs import spelled as _spelled

def tool_call_grammar(start: str, end: str, tools: list[ToolSpec], allow_text: bool,
                      token_ids: tuple[int | None, int | None] = (None, None),
                      parser: str = "json_tools", parallel: bool = False,
                      tags: dict[str, int] | None = None) -> Grammar:
    """The Lark grammar of one call to one of `tools` between `start` and `end` (with
    `allow_text`: or of text, then maybe such a call), the call's body in `parser`'s format
    (one of FORMATS). `parallel`: one or more calls where one is written.

    `token_ids`: the markers' ids where each is one added token of the tokenizer (Qwen's
    <tool_call>). llguidance keeps added tokens apart from text, so such a marker is written
    as its token (`<[id]>`): as text it could only be spelled out byte by byte, which the
    model never does. `tags`: likewise, the format's inner tags that are added tokens, by
    text (TAGS names them per format)."""
    if not tools:
        raise MlxkvError("a tool-call grammar needs at least one tool")
    if parser not in FORMATS:
        raise UnsupportedTools(f"no tool-call grammar for mlx-lm's {parser!r} format")
    rules = FORMATS[parser](lifted(tools), end, tags or {})
    open_id, close_id = token_ids
    close = _spelled(end, tags or {}) if close_id is None else f"<[{close_id}]>"
    opening = _spelled(start, tags or {}) if open_id is None else f"<[{open_id}]>"
    # Several calls: in one section where the format has sections (its `calls` rule), else a
    # newline apart, each between the markers.
    inner = parallel and parser in SECTIONED
    body = "calls" if inner else "body"
    sep = json.dumps(SEPARATORS.get(parser, "\n"))
    more = f' ({sep} {opening} body {close})*' if parallel and not inner else ""
    if opening.startswith("<["):  # a token, never text: text cannot run into it
        if not allow_text:
            return Grammar.lark(f"start: {opening} {body} {close}{more}\n{rules}\n")
        return Grammar.lark(f"start: TEXT? ({opening} {body} {close}{more})?\nTEXT: /(.|\\n)+/\n{rules}\n")
    if not allow_text:
        return Grammar.lark(f"start: {opening} {body} {close}{more}\n{rules}\n")
    marker = _regex(start)
    return Grammar.lark(
        f"start: TEXT | CALL_OPEN {body} {close}{more}\n"
        f"TEXT: /(.|\\n)*/ & ~/(.|\\n)*{marker}(.|\\n)*/\n"
        # Text up to the first marker, the marker included, as one lexeme: the lexer need not guess
        # where the text ends (a text lexeme that stopped before "<tool_call" could not go on).
        f"CALL_OPEN: /(.|\\n)*{marker}/ & ~/(.|\\n)*{marker}(.|\\n)+/\n"
        f"{rules}\n")


def _json_body(tools: list[ToolSpec], end: str, tags: dict[str, int]) -> str:
    calls = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.schema or ANY_OBJECT},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return f"body: {json_value(schema, _marks(end), {k: d for t in tools for k, d in t.defs.items()})}"


# The qwen3_coder parser's conversion of a parameter's text, by the property's "type".
_XML_INTEGER = "/-?(0|[1-9][0-9]{0,14})/"  # float() reads it back exactly: at most 15 digits
_XML_NUMBER = "/-?(0|[1-9][0-9]{0,14})(\\.[0-9]{1,15})?/"


def _xml_body(tools: list[ToolSpec], end: str, tags: dict[str, int]) -> str:
    """Qwen3-Coder's `<function=f>\\n<parameter=p>\\nvalue\\n</parameter>\\n</function>`."""
    rules = [f"body: \"\\n\" ({' | '.join(f'f{i}' for i in range(len(tools)))}) \"\\n\""]
    closing = [_regex("</parameter>")] + ([_regex(end)] if end else [])
    # A string value and its closing tag, one lexeme: text holding neither closing tag nor the
    # call's end marker, and not "null" (the parser reads any case of it as None).
    banned = " ".join(f"& ~/(.|\\n)*{m}(.|\\n)*\\n<\\/parameter>/" for m in closing)
    rules.append(f"STR: /(.|\\n)*\\n<\\/parameter>/ {banned} & ~/[nN][uU][lL][lL]\\n<\\/parameter>/")
    for i, tool in enumerate(tools):
        if not _XML_NAME.fullmatch(tool.name):
            raise UnsupportedTools(f"tool name {tool.name!r} cannot be written in the qwen3_coder format")
        params = _xml_params(tool, i, rules, end)
        rules.append(f"f{i}: {json.dumps(f'<function={tool.name}>')} \"\\n\" {params} \"</function>\"")
    return "\n".join(rules)


def _xml_params(tool: ToolSpec, i: int, rules: list[str], end: str) -> str:
    schema = tool.schema
    if schema is None:  # any parameters, read back as text
        rules.append(f'any{i}: "<parameter=" /[^\\s<>]+/ ">\\n" STR "\\n"')
        return f"any{i}*"
    required = set(schema.get("required") or [])
    parts = []
    for j, (name, prop) in enumerate(_properties(tool, "qwen3_coder").items()):
        value = _xml_value(tool, name, prop, end)
        rules.append(f"p{i}_{j}: {json.dumps(f'<parameter={name}>')} \"\\n\" {value} \"\\n\"")
        parts.append(f"p{i}_{j}" + ("" if name in required else "?"))
    return " ".join(parts) if parts else '""'


def _xml_value(tool: ToolSpec, name: str, prop, end: str) -> str:
    """The value's text and its closing tag, as the parser converts it to a value valid against `prop`."""
    where = f"tool {tool.name!r}, parameter {name!r}"
    if not isinstance(prop, dict):
        raise UnsupportedTools(f"{where}: its schema is not an object")
    prop = parser_typed(where, prop, tool.defs, ("object", "array"))
    kind, keys = prop.get("type"), set(prop) - _XML_ANNOTATIONS - {"type"}
    if kind in ("object", "array"):  # json.loads of the text: the schema holds as JSON does
        return f"{json_value(prop, _marks('</parameter>', end), tool.defs)} \"\\n</parameter>\""
    if kind == "string" and keys <= {"enum"} and all(isinstance(v, str) for v in prop.get("enum", [""])):
        if "enum" not in prop:
            return "STR"
        if any(v.lower() == "null" or "</parameter>" in v for v in prop["enum"]):
            raise UnsupportedTools(f"{where}: an enum value the parser would not read back")
        return "(" + " | ".join(json.dumps(v + "\n</parameter>") for v in prop["enum"]) + ")"
    if kind in ("integer", "number", "boolean") and not keys:
        value = {"integer": _XML_INTEGER, "number": _XML_NUMBER, "boolean": '("true" | "false")'}[kind]
        return f"{value} \"\\n</parameter>\""
    raise UnsupportedTools(f"{where}: the qwen3_coder format's parser cannot read a {_compact(prop)} "
                           f"value back exactly")


# What GLM's parser strips from a value (Python's str.strip: Rust's \s lacks \x1c-\x1f).
_GLM_EDGE = "[^\\s\\x1c-\\x1f]"


def _glm_body(tools: list[ToolSpec], end: str, tags: dict[str, int], names: tuple[str, ...] = (),
              fmt: str = "glm47") -> str:
    """GLM-4.7's `name<arg_key>k</arg_key><arg_value>v</arg_value>...`: a string property's value
    is read as its text, stripped; any other's as JSON. GLM's tokenizers have its tags as added
    tokens: those are written as their tokens (`tags`). `names`: the four tags (LongCat's differ)."""
    key, key_end, value, value_end = (_literal(t, tags) for t in names or TAGS["glm47"])
    raw_end = (names or TAGS["glm47"])[3]
    rules = [f"body: {' | '.join(f'f{i}' for i in range(len(tools)))}"]
    marks = [_regex(m) for m in (raw_end, end) if m]
    text = f"{_GLM_EDGE}((.|\\n)*{_GLM_EDGE})?"  # without the edge whitespace the parser would strip
    if raw_end in tags:  # the value's text, then the closing token
        banned = " ".join(f"& ~/(.|\\n)*{m}(.|\\n)*/" for m in marks)
        rules += [f"STR: /{text}/ {banned}", f"str: STR? {value_end}"]
    else:  # a string value and its closing tag, one lexeme: the lexer need not guess where the text ends
        banned = " ".join(f"& ~/(.|\\n)*{m}(.|\\n)*{_regex(raw_end)}/" for m in marks)
        rules += [f"STR: /({text})?{_regex(raw_end)}/ {banned}", "str: STR"]
    for i, tool in enumerate(tools):
        if not _XML_NAME.fullmatch(tool.name):
            raise UnsupportedTools(f"tool name {tool.name!r} cannot be written in the {fmt} format")
        if tool.schema is None:
            rules.append(f"any{i}: {key} /[^\\s<>]+/ {key_end} {value} str")
            params = f"any{i}*"
        else:
            params = _glm_params(tool, i, rules, (key, key_end, value, value_end), (raw_end, end), fmt)
        call = f"{json.dumps(tool.name)} {params}"
        rules.append(f"f{i}: {_some_or_json(tool, params) if fmt == 'longcat' else call}")
    return "\n".join(rules)


def _longcat_body(tools: list[ToolSpec], end: str, tags: dict[str, int]) -> str:
    """LongCat's: GLM's format under its own tag names."""
    return _glm_body(tools, end, tags, tagged_formats.LONGCAT_TAGS, "longcat")


def _some_or_json(tool: ToolSpec, params: str) -> str:
    """LongCat's parser reads a call's name up to its first argument, so a call without any is
    written as the JSON it reads instead: `{"name": "f", "arguments": {}}`."""
    empty = json.dumps(json.dumps({"name": tool.name, "arguments": {}}))
    name, parts = json.dumps(tool.name), params.split()
    if params == '""':
        return empty
    if parts[0].endswith("*"):  # any arguments
        return f"{name} {parts[0][:-1]}+ | {empty}"
    if not all(p.endswith("?") for p in parts):  # a required one is always written
        return f"{name} {params}"
    firsts = [" ".join([parts[k][:-1], *parts[k + 1:]]) for k in range(len(parts))]
    return f"{name} ({' | '.join(firsts)}) | {empty}"


def _glm_params(tool: ToolSpec, i: int, rules: list[str], tags: tuple[str, ...], marks: tuple[str, ...],
                fmt: str) -> str:
    parts = []
    key, key_end, value_open, close = tags
    for j, (name, prop) in enumerate(_properties(tool, fmt).items()):
        where = f"tool {tool.name!r}, parameter {name!r}"
        if not isinstance(prop, dict):
            raise UnsupportedTools(f"{where}: its schema is not an object")
        if prop.get("type") == "string":  # the parser keeps the text
            value = _glm_string(where, prop, close, marks[0], fmt)
        else:  # json.loads reads it back: the schema holds as JSON does
            value = f"{json_value(prop, _marks(*marks), tool.defs)} {close}"
        rules.append(f"p{i}_{j}: {key} {json.dumps(name)} {key_end} {value_open} {value}")
        parts.append(f"p{i}_{j}" + ("" if name in (tool.schema.get("required") or []) else "?"))
    return " ".join(parts) if parts else '""'


def _glm_string(where: str, prop: dict, close: str, raw_end: str, fmt: str) -> str:
    keys = set(prop) - _XML_ANNOTATIONS - {"type"}
    if not keys:
        return "str"
    if keys == {"enum"} and all(isinstance(v, str) and v == v.strip() and raw_end not in v
                                for v in prop["enum"]):
        return "(" + " | ".join(json.dumps(v) for v in prop["enum"]) + f") {close}"
    raise UnsupportedTools(f"{where}: the {fmt} format's parser cannot read a {_compact(prop)} value back exactly")


_PY_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _python_body(tools: list[ToolSpec], end: str, tags: dict[str, int]) -> str:
    """Pythonic `[name(k=value, ...)]`: each value JSON, which Python's parser reads as the same
    value (llguidance writes no `\\/` or `\\u` escapes; the parser maps true/false/null)."""
    import keyword

    rules = [f"body: \"[\" ({' | '.join(f'f{i}' for i in range(len(tools)))}) \"]\""]
    for i, tool in enumerate(tools):
        if not all(_PY_NAME.fullmatch(part) and not keyword.iskeyword(part) for part in tool.name.split(".")):
            raise UnsupportedTools(f"tool name {tool.name!r} cannot be written in the pythonic format")
        if tool.schema is None:
            arg = f'/[A-Za-z_][A-Za-z0-9_]*/ "=" {json_value(True, _marks(end))}'
            rules.append(f"a{i}: {arg}")
            rules.append(f"f{i}: {json.dumps(tool.name + '(')} (a{i} (\", \" a{i})*)? \")\"")
            continue
        properties = _properties(tool, "pythonic")
        required = set(tool.schema.get("required") or [])
        names = list(properties)
        for j, name in enumerate(names):
            if keyword.iskeyword(name) or not _PY_NAME.fullmatch(name):
                raise UnsupportedTools(f"tool {tool.name!r}: parameter {name!r} is not a Python keyword argument")
            rules.append(f"p{i}_{j}: {json.dumps(name + '=')} {json_value(properties[name], _marks(end), tool.defs)}")
        # Commas between the arguments written, optional ones anywhere: t{k} is the rest from
        # argument k when none is written yet, s{k} when one is.
        n = len(names)
        rules += [f't{i}_{n}: ""', f's{i}_{n}: ""']
        for j in reversed(range(n)):
            if names[j] in required:
                rules += [f"t{i}_{j}: p{i}_{j} s{i}_{j + 1}", f's{i}_{j}: ", " p{i}_{j} s{i}_{j + 1}']
            else:
                rules += [f"t{i}_{j}: p{i}_{j} s{i}_{j + 1} | t{i}_{j + 1}",
                          f's{i}_{j}: (", " p{i}_{j})? s{i}_{j + 1}']
        rules.append(f"f{i}: {json.dumps(tool.name + '(')} t{i}_0 \")\"")
    return "\n".join(rules)


def _kimi_body(tools: list[ToolSpec], end: str, tags: dict[str, int]) -> str:
    """Kimi-K2's section of calls, each `<|tool_call_begin|>functions.name:i
    <|tool_call_argument_begin|>{json}<|tool_call_end|>` (the parser reads `functions.name:i` as
    the call's id, the JSON as the arguments)."""
    begin, arguments, call_end = (_literal(t, tags) for t in TAGS["kimi_k2"])
    rules = [f"body: {begin} ({' | '.join(f'f{i}' for i in range(len(tools)))}) {call_end}", "calls: body+"]
    for i, tool in enumerate(tools):
        if not _KIMI_NAME.fullmatch(tool.name):
            raise UnsupportedTools(f"tool name {tool.name!r} cannot be written in the kimi_k2 format")
        value = json_value(tool.schema or ANY_OBJECT, _marks(*TAGS["kimi_k2"], end), tool.defs)
        rules.append(f"f{i}: {json.dumps(f'functions.{tool.name}:')} /[0-9]{{1,4}}/ {arguments} {value}")
    return "\n".join(rules)


_KIMI_NAME = re.compile(r"[^\s:<>]+")  # the parser reads the name up to ":<digits>"
FORMATS = {"json_tools": _json_body, "qwen3_coder": _xml_body, "glm47": _glm_body, "pythonic": _python_body,
           "kimi_k2": _kimi_body, "longcat": _longcat_body, **tagged_formats.FORMATS}
SECTIONED = ("kimi_k2", *tagged_formats.SECTIONED)  # formats whose several calls share one pair of markers
SEPARATORS = tagged_formats.SEPARATORS


# Each format's inner tags, which a tokenizer may hold as added tokens.
TAGS = {"glm47": ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
        "kimi_k2": ("<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"),
        **tagged_formats.TAGS}


def _marks(*texts: str) -> tuple[str, ...]:
    """The texts a JSON value's strings may not hold: where the parser would end the call."""
    return tuple(t for t in texts if t)
