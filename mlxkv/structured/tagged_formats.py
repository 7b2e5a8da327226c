"""Tool-call grammars for mlx-lm's newer call formats (tool_grammar.py holds the first five).

Each writes exactly what its parser (mlx_lm.tool_parsers.<name>) reads back:

- `minimax_m2`: `<invoke name="f"><parameter name="p">value</parameter>...</invoke>` per call,
  one section; a value's text converted by the property's type (minicpm5 shares the conversion).
- `minicpm5`: `<function name="f"><param name="p">value</param>...</function>` per call.
- `muse_spark`: `<atem:invoke name="f"><atem:parameter name="p">JSON</atem:parameter>...`
  per call, one section; each value JSON (the parser tries JSON first).
- `kimi_k3`: `<|open|>call tool="f" index="i"<|sep|>` then one
  `<|open|>argument key="p" type="t"<|sep|>value<|close|>argument<|sep|>` per argument: a string
  property's raw text under type="string", any other's JSON.
- `function_gemma`: `call:f{p:<escape>text<escape>,q:3}`: strings between `<escape>` tags,
  numbers and flags bare (no arrays or objects: the parser splits at commas and the call ends
  at the first `}`).
- `gemma4`: `call:f{p:<|"|>text<|"|>,q:[1,2]}`: JSON with bare keys and strings between
  `<|"|>` delimiters (raw text), written per schema (strings, numbers, flags, null, arrays,
  objects of properties; other keywords are refused).
- `mistral`: `[TOOL_CALLS]f[ARGS]{JSON}`, repeated for several calls (no end marker).
- `longcat`: GLM's format under LongCat's tag names (tool_grammar's `_glm_body`).

A raw text value is kept from holding the texts where its parser would cut it, and from
the edge whitespace or "null" a parser would strip or read as None; JSON values' strings
likewise (json_strings.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from mlxkv.structured.tool_refs import deref, ref_name
from mlxkv.structured.tool_specs import (ANNOTATIONS, ToolSpec, UnsupportedTools, json_value, literal,
                                         parser_typed, properties, regex, spelled)

_EDGE = "[^\\s\\x1c-\\x1f]"  # a character str.strip() keeps
_INTEGER = "/-?(0|[1-9][0-9]*)/"
_NUMBER = "/-?(0|[1-9][0-9]{0,14})(\\.[0-9]{1,15})?/"  # float() reads it back exactly
_ATTR_NAME = re.compile(r'[^\s"&<>]+')  # a name the parsers read back from name="..."
_WORD = re.compile(r"[A-Za-z0-9_]+")
_DASHED_NAME = re.compile(r"[A-Za-z0-9_-]+")  # Mistral's and Gemma 4's parsers' tool names


@dataclass(frozen=True)
class RawText:
    """How a format's parser reads a string argument's raw text."""
    close: str  # the text that ends the value
    banned: tuple[str, ...] = ()  # texts the value may not hold: the parser would cut it there
    strip: bool = False  # the parser strips edge whitespace: the grammar writes none
    no_null: bool = False  # the parser reads "null", in any case, as None
    refused: tuple[str, ...] = ()  # regexes of whole texts the parser would read otherwise


def raw_text(rules: list[str], name: str, raw: RawText, tags: dict[str, int]) -> str:
    """A raw text value then its closing, as Lark: adds terminal `name` to `rules`."""
    text = f"{_EDGE}((.|\\n)*{_EDGE})?" if raw.strip else "(.|\\n)+"
    bans = [f"(.|\\n)*{regex(m)}(.|\\n)*" for m in (raw.close, *raw.banned) if m]
    bans += (["[nN][uU][lL][lL]"] if raw.no_null else []) + list(raw.refused)
    close = spelled(raw.close, tags)
    if close.startswith("<["):  # the closing is a token: the text, then it
        rules.append(f"{name}: /{text}/" + "".join(f" & ~/{b}/" for b in bans))
        return f"{name}? {close}"
    # The text and its closing as one lexeme: the lexer need not guess where the text ends.
    end = regex(raw.close)
    rules.append(f"{name}: /({text})?{end}/" + "".join(f" & ~/({b}){end}/" for b in bans))
    return name


def typed_value(where: str, prop, raw: RawText, tags: dict[str, int], rules: list[str], name: str,
                defs: dict | None = None) -> str:
    """A value as MiniMax's parser converts its text by the property's type (as Qwen3-Coder's
    does): a string's text, an integer, number or flag's text, an object or array's JSON."""
    if not isinstance(prop, dict):
        raise UnsupportedTools(f"{where}: its schema is not an object")
    prop = parser_typed(where, prop, defs or {}, ("string",))
    kind, keys = prop.get("type"), set(prop) - ANNOTATIONS - {"type"}
    close = spelled(raw.close, tags)
    if kind in ("object", "array"):  # json.loads of the text: the schema holds as JSON does
        return f"{json_value(prop, (raw.close, *raw.banned), defs)} {close}"
    if kind == "string" and keys <= {"enum"} and all(isinstance(v, str) for v in prop.get("enum", [""])):
        if "enum" not in prop:
            return raw_text(rules, name, raw, tags)
        if not all(_reads_back(v, raw) for v in prop["enum"]):
            raise UnsupportedTools(f"{where}: an enum value the parser would not read back")
        return "(" + " | ".join(json.dumps(v) for v in prop["enum"]) + f") {close}"
    if kind in ("integer", "number", "boolean") and not keys:
        return {"integer": _INTEGER, "number": _NUMBER, "boolean": '("true" | "false")'}[kind] + f" {close}"
    raise UnsupportedTools(f"{where}: the format's parser cannot read a {json.dumps(prop)} value back exactly")


def _reads_back(value: str, raw: RawText) -> bool:
    """An enum value the parser reads back as written, in this raw-text form."""
    if raw.strip and value != value.strip() or raw.no_null and value.lower() == "null":
        return False
    return not any(m and m in value for m in (raw.close, *raw.banned)) and \
        not any(re.fullmatch(r, value) for r in raw.refused)


def _alternatives(tools: list[ToolSpec]) -> str:
    return " | ".join(f"f{i}" for i in range(len(tools)))


def _in_order(schema: dict, key: str, rules: list[str], written: list[str], sep: str = "") -> str:
    """An object's arguments in the schema's order, required ones present, optional ones maybe,
    `sep` between those written: rule t{key}_k is the rest from argument k before any is
    written, s{key}_k after one is."""
    required = set(schema.get("required") or [])
    names = list(schema.get("properties") or {})
    n, sep = len(names), json.dumps(sep) if sep else ""
    rules += [f't{key}_{n}: ""', f's{key}_{n}: ""']
    for j in reversed(range(n)):
        p = written[j]
        if names[j] in required:
            rules += [f"t{key}_{j}: {p} s{key}_{j + 1}", f"s{key}_{j}: {sep} {p} s{key}_{j + 1}"]
        else:
            rules += [f"t{key}_{j}: {p} s{key}_{j + 1} | t{key}_{j + 1}",
                      f"s{key}_{j}: ({sep} {p})? s{key}_{j + 1}"]
    return f"t{key}_0"


def _tag_params(tool: ToolSpec, i: int, rules: list[str], fmt: str, names: re.Pattern, param) -> str:
    """The tool's arguments, each written by `param(j, name, prop)` (a rule's text)."""
    written = []
    for j, (name, prop) in enumerate(properties(tool, fmt, names).items()):
        rules.append(f"p{i}_{j}: {param(j, name, prop)}")
        written.append(f"p{i}_{j}")
    return _in_order(tool.schema, str(i), rules, written)


def _check_name(tool: ToolSpec, names: re.Pattern, fmt: str):
    if not names.fullmatch(tool.name):
        raise UnsupportedTools(f"tool name {tool.name!r} cannot be written in the {fmt} format")


def _typed_params(tool: ToolSpec, i: int, rules: list[str], fmt: str, raw: RawText, tags: dict[str, int],
                  tag: str, after: str = "") -> str:
    """MiniMax's and MiniCPM's arguments: `<tag name="p">` then the value as their shared
    conversion reads it (then `after`), each; any names, read as text, for a tool without a schema."""
    _check_name(tool, _ATTR_NAME, fmt)
    if tool.schema is None:
        rules.append(f'any{i}: "<{tag} name=\\"" /[^\\s"&<>]+/ "\\">" {raw_text(rules, f"R{i}", raw, tags)}{after}')
        return f"any{i}*"

    def param(j, name, prop):
        value = typed_value(f"tool {tool.name!r}, parameter {name!r}", prop, raw, tags, rules, f"S{i}_{j}",
                            tool.defs)
        return f'{json.dumps(f"<{tag} name={json.dumps(name)}>")} {value}{after}'
    return _tag_params(tool, i, rules, fmt, _ATTR_NAME, param)


def _minimax_body(tools: list[ToolSpec], end: str, tags: dict[str, int]) -> str:
    """`\\n<invoke name="f">\\n<parameter name="p">value</parameter>\\n...</invoke>\\n` per call."""
    raw = RawText("</parameter>", ("</invoke>", end), strip=True, no_null=True)
    rules = [f'one: ({_alternatives(tools)}) "\\n"', 'body: "\\n" one', 'calls: "\\n" one+']
    for i, tool in enumerate(tools):
        params = _typed_params(tool, i, rules, "minimax_m2", raw, tags, "parameter", after=' "\\n"')
        rules.append(f'f{i}: {json.dumps(f"<invoke name={json.dumps(tool.name)}>")} "\\n" {params} "</invoke>"')
    return "\n".join(rules)


def _minicpm_body(tools: list[ToolSpec], end: str, tags: dict[str, int]) -> str:
    """After the `<function name=` marker: `"f"><param name="p">value</param>...`."""
    raw = RawText("</param>", ("</function>", end), strip=True, no_null=True,
                  refused=("<!\\[CDATA\\[(.|\\n)*",))  # the parser unwraps a CDATA block
    rules = [f"body: {_alternatives(tools)}"]
    for i, tool in enumerate(tools):
        params = _typed_params(tool, i, rules, "minicpm5", raw, tags, "param")
        rules.append(f'f{i}: {json.dumps(json.dumps(tool.name) + ">")} {params}')
    return "\n".join(rules)


def _muse_body(tools: list[ToolSpec], end: str, tags: dict[str, int]) -> str:
    """`<atem:invoke name="f"><atem:parameter name="p">JSON</atem:parameter>...</atem:invoke>`."""
    marks = tuple(m for m in ("</atem:parameter>", "</atem:invoke>", end) if m)
    rules = [f"body: {_alternatives(tools)}", "calls: body+"]
    for i, tool in enumerate(tools):
        _check_name(tool, _ATTR_NAME, "muse_spark")
        if tool.schema is None:
            rules.append(f'any{i}: "<atem:parameter name=\\"" /[^\\s"&<>]+/ "\\">" {json_value(True, marks)} '
                         f'"</atem:parameter>"')
            params = f"any{i}*"
        else:
            def param(j, name, prop):
                return (f'{json.dumps(f"<atem:parameter name={json.dumps(name)}>")} '
                        f'{json_value(prop, marks, tool.defs)} '
                        f'"</atem:parameter>"')
            params = _tag_params(tool, i, rules, "muse_spark", _ATTR_NAME, param)
        rules.append(f'f{i}: {json.dumps(f"<atem:invoke name={json.dumps(tool.name)}>")} {params} "</atem:invoke>"')
    return "\n".join(rules)


KIMI_K3_TAGS = ("<|open|>", "<|close|>", "<|sep|>")


def _kimi_k3_body(tools: list[ToolSpec], end: str, tags: dict[str, int]) -> str:
    """`<|open|>call tool="f" index="i"<|sep|>` arguments `<|close|>call<|sep|>` per call, one
    section; a string property's raw text (type="string"), any other's JSON."""
    opening, closing, sep = (literal(t, tags) for t in KIMI_K3_TAGS)
    raw = RawText("<|close|>argument<|sep|>", ("<|close|>",))  # the parser keeps the text as it is
    rules = [f"body: {_alternatives(tools)}", "calls: body+"]
    argument_end = spelled("<|close|>argument<|sep|>", tags)
    for i, tool in enumerate(tools):
        _check_name(tool, _ATTR_NAME, "kimi_k3")
        if tool.schema is None:
            rules.append(f'any{i}: {opening} "argument key=\\"" /[^\\s"&<>]+/ ("\\" type=\\"json\\"" {sep} '
                         f'{json_value(True, ("<|close|>",))} {argument_end} | "\\" type=\\"string\\"" {sep} '
                         f'{raw_text(rules, f"R{i}", raw, tags)})')
            params = f"any{i}*"
        else:
            def param(j, name, prop, i=i):
                prop = deref(prop, tool.defs)  # the type="..." written tells the parser how to read it
                head = f'{opening} {json.dumps(f"argument key={json.dumps(name)} type=")}'
                # A schema of true/false is no object: any JSON, or none.
                kind = prop.get("type") if isinstance(prop, dict) and isinstance(prop.get("type"), str) else "json"
                keys = set(prop) - ANNOTATIONS - {"type"} if isinstance(prop, dict) else {0}
                if kind == "string" and not keys:
                    return f'{head} "\\"string\\"" {sep} {raw_text(rules, f"S{i}_{j}", raw, tags)}'
                if kind == "string" and keys == {"enum"} and all(
                        isinstance(v, str) and _reads_back(v, raw) for v in prop["enum"]):
                    values = " | ".join(json.dumps(v) for v in prop["enum"])
                    return f'{head} "\\"string\\"" {sep} ({values}) {argument_end}'
                kind = "json" if kind == "string" else kind  # a constrained string: its JSON
                value = json_value(prop, ("<|close|>",), tool.defs)
                return f'{head} {json.dumps(json.dumps(kind))} {sep} {value} {argument_end}'
            params = _tag_params(tool, i, rules, "kimi_k3", _ATTR_NAME, param)
        rules.append(f'f{i}: {opening} {json.dumps(f"call tool={json.dumps(tool.name)} index=")} '
                     f'/"[0-9]{{1,4}}"/ {sep} {params} {closing} "call" {sep}')
    return "\n".join(rules)


def _function_gemma_body(tools: list[ToolSpec], end: str, tags: dict[str, int]) -> str:
    """`call:f{p:<escape>text<escape>,q:3}`."""
    escape = literal("<escape>", tags)
    raw = RawText("<escape>", ("}", end))  # the call ends at the first "}"
    scalars = {"integer": _INTEGER, "number": _NUMBER, "boolean": '("true" | "false")'}
    rules = [f"body: {_alternatives(tools)}"]
    for i, tool in enumerate(tools):
        _check_name(tool, _WORD, "function_gemma")
        if tool.schema is None:
            value = f'({escape} {raw_text(rules, f"R{i}", raw, tags)} | {_NUMBER} | "true" | "false" | "null")'
            rules.append(f'any{i}: /[A-Za-z0-9_]+/ ":" {value}')
            params = f'(any{i} ("," any{i})*)?'
        else:
            def param(j, name, prop, i=i):
                prop = deref(prop, tool.defs)  # the parser reads no schema: strings and numbers by their look
                where = f"tool {tool.name!r}, parameter {name!r}"
                if not isinstance(prop, dict):
                    raise UnsupportedTools(f"{where}: its schema is not an object")
                kind, keys = prop.get("type"), set(prop) - ANNOTATIONS - {"type"}
                if kind == "string" and keys <= {"enum"}:
                    if "enum" not in prop:
                        value = f"{escape} {raw_text(rules, f'S{i}_{j}', raw, tags)}"
                    elif all(isinstance(v, str) and _reads_back(v, raw) for v in prop["enum"]):
                        value = "(" + " | ".join(f"{escape} {json.dumps(v)} {escape}" for v in prop["enum"]) + ")"
                    else:
                        raise UnsupportedTools(f"{where}: an enum value the parser would not read back")
                elif kind in scalars and not keys:
                    value = scalars[kind]
                else:
                    raise UnsupportedTools(f"{where}: the function_gemma format's parser cannot read a "
                                           f"{json.dumps(prop)} value back exactly")
                return f"{json.dumps(name + ':')} {value}"
            written = []
            for j, (name, prop) in enumerate(properties(tool, "function_gemma", _WORD).items()):
                rules.append(f"p{i}_{j}: {param(j, name, prop)}")
                written.append(f"p{i}_{j}")
            params = _in_order(tool.schema, str(i), rules, written, sep=",")
        rules.append(f'f{i}: {json.dumps(f"call:{tool.name}" + "{")} {params} "}}"')
    return "\n".join(rules)


GEMMA4_QUOTE = '<|"|>'  # Gemma 4's string delimiter


class _Gemma4Values:
    """Gemma 4's argument values as Lark, per schema: JSON with bare keys (`{city:...}`) and
    strings between `<|"|>` delimiters (raw text, no escapes), which the parser turns into JSON."""

    def __init__(self, rules: list[str], end: str, tags: dict[str, int], defs: dict):
        self.rules, self.tags, self.count = rules, tags, 0
        self.defs, self.def_rules = defs, {}  # the tools' lifted definitions; each one's rule, once written
        self.quote = literal(GEMMA4_QUOTE, tags)
        self.raw = RawText(GEMMA4_QUOTE, (end,))
        self.text = f"{self.quote} {raw_text(rules, 'GSTR', self.raw, tags)}"
        rules += [f'gany: {self.text} | {_NUMBER} | "true" | "false" | "null" | "[" (gany ("," gany)*)? "]" '
                  f'| "{{" (/[A-Za-z0-9_]+/ ":" gany ("," /[A-Za-z0-9_]+/ ":" gany)*)? "}}"']

    def value(self, where: str, schema) -> str:
        if schema is True or schema == {} or schema is None:
            return "gany"
        if not isinstance(schema, dict):
            raise UnsupportedTools(f"{where}: its schema is not an object")
        if ref_name(schema) in self.defs:
            return self.definition(where, ref_name(schema))
        kind, keys = schema.get("type"), set(schema) - ANNOTATIONS - {"type"}
        if kind == "string" and keys <= {"enum"}:
            if "enum" not in schema:
                return self.text
            if not all(isinstance(v, str) and _reads_back(v, self.raw) for v in schema["enum"]):
                raise UnsupportedTools(f"{where}: an enum value the parser would not read back")
            return "(" + " | ".join(f"{self.quote} {json.dumps(v)} {self.quote}" for v in schema["enum"]) + ")"
        scalars = {"integer": _INTEGER, "number": _NUMBER, "boolean": '("true" | "false")', "null": '"null"'}
        if kind in scalars and not keys:
            return scalars[kind]
        if kind == "array" and keys <= {"items"}:
            item = self.value(f"{where} items", schema.get("items"))
            return f'"[" ({item} ("," {item})*)? "]"'
        if kind == "object" and keys <= {"properties", "required", "additionalProperties"}:
            return self.object(where, schema)
        raise UnsupportedTools(f"{where}: the gemma4 format's parser cannot read a {json.dumps(schema)} value "
                               f"back exactly")

    def definition(self, where: str, name: str) -> str:
        """A lifted definition as one rule, named before it is written: it may refer to itself."""
        if name not in self.def_rules:
            self.def_rules[name] = rule = f"gd{len(self.def_rules)}"
            self.rules.append(f"{rule}: {self.value(where, self.defs[name])}")
        return self.def_rules[name]

    def object(self, where: str, schema: dict) -> str:
        props = schema.get("properties") or {}
        if not props:
            return "gany"  # an open object: any keys
        if not set(schema.get("required") or []) <= set(props):
            raise UnsupportedTools(f"{where}: required properties missing from its properties")
        self.count += 1
        key, written = f"g{self.count}", []
        for j, (name, prop) in enumerate(props.items()):
            if not _WORD.fullmatch(name):
                raise UnsupportedTools(f"{where}: key {name!r} cannot be written bare in the gemma4 format")
            self.rules.append(f"{key}p{j}: {json.dumps(name + ':')} {self.value(f'{where}.{name}', prop)}")
            written.append(f"{key}p{j}")
        return f'"{{" {_in_order(schema, key, self.rules, written, sep=",")} "}}"'


def _gemma4_body(tools: list[ToolSpec], end: str, tags: dict[str, int]) -> str:
    """`call:f{key:value,...}`: each tool's arguments as Gemma 4 writes them."""
    rules = [f"body: {_alternatives(tools)}"]
    values = _Gemma4Values(rules, end, tags, {k: d for t in tools for k, d in t.defs.items()})
    for i, tool in enumerate(tools):
        _check_name(tool, _DASHED_NAME, "gemma4")
        schema = tool.schema if tool.schema is not None else {"type": "object"}
        if schema.get("type", "object") != "object":
            raise UnsupportedTools(f"tool {tool.name!r}: its arguments' schema is not an object")
        arguments = values.object(f"tool {tool.name!r}", {**schema, "type": "object"})
        if arguments == "gany":  # an open object: gany may be any value
            arguments = '"{" (/[A-Za-z0-9_]+/ ":" gany ("," /[A-Za-z0-9_]+/ ":" gany)*)? "}"'
        rules.append(f"f{i}: {json.dumps(f'call:{tool.name}')} {arguments}")
    return "\n".join(rules)




def _mistral_body(tools: list[ToolSpec], end: str, tags: dict[str, int]) -> str:
    """`f[ARGS]{JSON}` after the [TOOL_CALLS] marker (the parser reads one JSON value after
    each `name[ARGS]`, so no text in it ends the call)."""
    args = literal("[ARGS]", tags)
    rules = [f"body: {_alternatives(tools)}"]
    for i, tool in enumerate(tools):
        _check_name(tool, _DASHED_NAME, "mistral")
        value = json_value(tool.schema or {"type": "object"}, (), tool.defs)
        rules.append(f"f{i}: {json.dumps(tool.name)} {args} {value}")
    return "\n".join(rules)


LONGCAT_TAGS = ("<longcat_arg_key>", "</longcat_arg_key>", "<longcat_arg_value>", "</longcat_arg_value>")
FORMATS = {"minimax_m2": _minimax_body, "minicpm5": _minicpm_body, "muse_spark": _muse_body,
           "kimi_k3": _kimi_k3_body, "function_gemma": _function_gemma_body, "mistral": _mistral_body,
           "gemma4": _gemma4_body}
SECTIONED = ("minimax_m2", "muse_spark", "kimi_k3")
TAGS = {"kimi_k3": KIMI_K3_TAGS, "gemma4": (GEMMA4_QUOTE,), "function_gemma": ("<escape>",), "mistral": ("[ARGS]",),
        "longcat": LONGCAT_TAGS}
SEPARATORS = {"mistral": ""}  # what stands between several calls' markers (else a newline)
