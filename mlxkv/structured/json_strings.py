"""JSON schemas whose strings cannot hold a given text (a tool-call format's closing marker).

A tool call's parser finds where a call (or an argument) ends by searching
for its closing marker (`</tool_call>`, `</parameter>`): a JSON string that
held it would cut the call there. llguidance writes a string's characters as
they are (no `\\u` escapes but control characters), so a string whose value
lacks the marker is written without it. `without_markers` rewrites a schema
so that every string in it (values, and an open object's keys) matches a
regex of the texts that do not contain the markers; a part that allows any
value is given a definition of any JSON built the same way.
"""

from __future__ import annotations

ANY = "#/$defs/mlxkv_any"  # the added definition of any JSON whose strings lack the markers
STRING = "#/$defs/mlxkv_string"  # and of such a string: plain strings refer to it, compiled once
_ANNOTATIONS = ("description", "title", "default", "examples", "$comment")
# A string with its own pattern, format or minimum length is left as it is: llguidance cannot
# always meet such a rule with the markers' pattern ("Unable to determine if regex is empty"
# for a minLength of 100 already), and a request that compiled must not become a 400. An enum
# or const string is the schema's own text: a pattern there could only empty it.
_OWN_STRING_RULES = {"pattern", "format", "minLength", "enum", "const"}
_COMBINATORS = ("anyOf", "oneOf", "allOf")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMAS = ("items", "additionalProperties", "contains", "not", "if", "then", "else")
_VALUE_KEYS = ("type", "enum", "const", "$ref", *_COMBINATORS, "not")


def excluding(marker: str) -> str:
    """A regex (Rust/llguidance syntax) of the texts that do not contain `marker`.

    The marker's first character may not occur again in it (true of every tool-call marker):
    then a text is a run without that character, then blocks that each start with it and hold
    it nowhere else, and the marker could only lie inside one block, at its start. So no block
    may start with the whole marker: after each matched character of it, the block ends, or
    goes on with any character but the next one. It is regular and needs no lookaround, which
    llguidance's regexes lack, and its size grows with the marker's length, not its square."""
    c0, rest = marker[:1], marker[1:]
    if not marker or c0 in rest:
        raise ValueError(f"cannot build a regex excluding {marker!r}")
    free = f"[^{_in_class(c0)}]*"
    block = ""  # the block's continuation after rest[:j], built from the marker's end
    for j in reversed(range(len(rest))):
        stop = f"[^{_in_class(rest[j])}{_in_class(c0)}]{free}"
        block = f"(?:{stop}|{_escaped(rest[j])}{block})?" if block else f"(?:{stop})?"
    return f"{free}(?:{_escaped(c0)}{block})*"


def without_markers(schema, markers: tuple[str, ...]) -> dict:
    """`schema` with every string kept from holding any of `markers` (a dict schema: the root)."""
    if not markers:
        return schema
    patterns = [{"pattern": f"^{excluding(m)}$", "marker": m} for m in markers]
    rewritten = _rewrite(schema, patterns)
    if not isinstance(rewritten, dict):
        rewritten = {} if rewritten is True else {"not": {}}
    string = _keep_out({"type": "string"}, patterns)
    any_value = {"anyOf": [{"$ref": STRING}, {"type": ["number", "integer", "boolean", "null"]},
                           {"type": "array", "items": {"$ref": ANY}}, _open_object(patterns, {"$ref": ANY})]}
    return {**rewritten, "$defs": {**rewritten.get("$defs", {}), "mlxkv_any": any_value, "mlxkv_string": string}}


def _rewrite(schema, patterns):
    if schema is True or schema == {}:
        return {"$ref": ANY}
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _COMBINATORS:
        if isinstance(out.get(key), list):
            out[key] = [_rewrite(s, patterns) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: _rewrite(s, patterns) for k, s in out[key].items()}
    for key in _SUBSCHEMAS:
        if key in out and key != "additionalProperties":
            out[key] = _rewrite(out[key], patterns)
    if isinstance(out.get("prefixItems"), list):
        out["prefixItems"] = [_rewrite(s, patterns) for s in out["prefixItems"]]
    kinds = out.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds or []
    if out.get("type") == "string" and not set(out) - {"type", *_ANNOTATIONS}:
        return {"$ref": STRING}
    if "string" in kinds and not _OWN_STRING_RULES & set(out):
        _keep_out(out, patterns)
    named = set(out.get("properties") or {})
    if named and set(out.get("required") or []) <= named or "patternProperties" in out:
        # Only the named keys: narrower than the schema, never outside it. (Open keys beside
        # named ones would need a key pattern that leaves the names out, or llguidance meets
        # both schemas on a named key, recursively.)
        out["additionalProperties"] = False
    elif "object" in kinds or "additionalProperties" in out:  # open keys, and their values
        extra = out.get("additionalProperties", True)
        if extra is not False:
            out = _open_object(patterns, _rewrite(extra, patterns), out)
    elif not any(k in out for k in _VALUE_KEYS):  # annotations only: any value
        out = {**out, "$ref": ANY}
    return out


def _keep_out(string: dict, patterns) -> dict:
    """A string schema given the patterns: the first as its own `pattern`, the rest in allOf."""
    string["pattern"] = patterns[0]["pattern"]
    if patterns[1:]:
        string["allOf"] = [*string.get("allOf", []), *({"pattern": p["pattern"]} for p in patterns[1:])]
    return string


def _open_object(patterns, values, base: dict | None = None) -> dict:
    """An object whose extra keys lack the markers' first characters (llguidance has no
    propertyNames; one key pattern that rejects every other key does it, and a key with `<` in
    it is rare enough to give up)."""
    firsts = "".join(sorted({_in_class(p["marker"][0]) for p in patterns}))
    shape = {"type": "object", **(base or {})}
    shape["patternProperties"] = {**shape.get("patternProperties", {}), f"^[^{firsts}]*$": values}
    shape["additionalProperties"] = False
    return shape


def _escaped(text: str) -> str:
    return "".join(_in_class(c) for c in text)


def _in_class(c: str) -> str:
    """One character as a regex literal, in or out of a class (only punctuation that is a regex
    operator is escaped: Rust's regex reads `\\<` as a word boundary)."""
    if c == "\n":
        return "\\n"
    return "\\" + c if c in "\\.+*?()|[]{}^$#&-~/" else c
