"""Tools whose parameters refer to their own definitions ($defs / definitions, as Pydantic and
MCP servers write them), in every tool-call format, table-driven, with mlx-lm's parser as the
oracle (test_tagged_formats.py): two tools' same-named definitions stay apart, a recursive
definition is enforced at every depth, strings reached through a ref keep the closing marker
out, and a ref that leads nowhere is a clear error naming the tool."""

from __future__ import annotations

import json
import re

import pytest

from mlxkv.structured.tool_grammar import FORMATS, ToolSpec, UnsupportedTools, tool_call_grammar
from mlxkv.structured.tool_refs import BadToolSchema
from test_tagged_formats import (CASES, Case, function_gemma, gemma4, grammar, minicpm, minimax, mistral,
                                 muse, reads_back_valid)
from test_tool_formats import accepts, glm_call, kimi_call, py_call, xml_call


def _text(v) -> str:
    return v if isinstance(v, str) else json.dumps(v)


def json_tools(calls):
    return "\n".join(f"<tool_call>{json.dumps({'name': n, 'arguments': a})}</tool_call>" for n, a in calls)


def qwen3_coder(calls):
    return "\n".join(xml_call(n, **{k: _text(v) for k, v in a.items()}) for n, a in calls)


def glm47(calls):  # a $ref parameter has no "type": string for GLM's parser, so it reads JSON
    return "\n".join(glm_call(n, **{k: json.dumps(v) for k, v in a.items()}) for n, a in calls)


def longcat(calls):  # likewise
    return "\n".join(f"<longcat_tool_call>{n}" + "".join(
        f"<longcat_arg_key>{k}</longcat_arg_key><longcat_arg_value>{json.dumps(v)}</longcat_arg_value>"
        for k, v in a.items()) + "</longcat_tool_call>" for n, a in calls)


def pythonic(calls):
    return "\n".join(py_call(n, **{k: json.dumps(v) for k, v in a.items()}) for n, a in calls)


def kimi_k2(calls):
    return kimi_call(*((n, i, a) for i, (n, a) in enumerate(calls)))


def kimi_k3(calls):  # the type attribute as the grammar writes it: the referred definition's type
    kinds = {str: "string", int: "integer", dict: "object", list: "array"}

    def argument(k, v):
        return f'<|open|>argument key="{k}" type="{kinds[type(v)]}"<|sep|>{_text(v)}<|close|>argument<|sep|>'
    body = "".join(f'<|open|>call tool="{n}" index="{i}"<|sep|>' + "".join(argument(k, v) for k, v in a.items())
                   + "<|close|>call<|sep|>" for i, (n, a) in enumerate(calls))
    return f"<|open|>tools<|sep|>{body}<|close|>tools<|sep|>"


WRITERS = {"json_tools": json_tools, "qwen3_coder": qwen3_coder, "glm47": glm47, "laguna": glm47,
           "pythonic": pythonic, "kimi_k2": kimi_k2, "kimi_k3": kimi_k3, "minimax_m2": minimax,
           "minicpm5": minicpm, "muse_spark": muse, "function_gemma": function_gemma, "gemma4": gemma4,
           "mistral": mistral, "longcat": longcat}
MARKERS = {"json_tools": "</tool_call>", "qwen3_coder": "</parameter>", "glm47": "</arg_value>",
           "pythonic": "<|tool_call_end|>", "kimi_k2": "<|tool_call_end|>",
           **{c.parser: c.marker for c in CASES if c.parser != "function_gemma"}}


def case(parser: str, tools: list[ToolSpec]) -> Case:
    return Case(parser, WRITERS[parser], MARKERS.get(parser, ""), tools)


def with_item(item: dict) -> dict:
    return {"type": "object", "properties": {"n": {"$ref": "#/$defs/Item"}}, "required": ["n"],
            "$defs": {"Item": item}}


# Two tools each define `Item`, differently. Parsers that convert a value by its property's
# "type" see none on a $ref: Qwen3-Coder's keeps JSON objects and arrays, MiniMax's and
# MiniCPM's text, so their Items are of those kinds.
ITEMS = {"scalar": ({"type": "integer"}, {"type": "string", "enum": ["x", "y"]}, 3, "x"),
         "array": ({"type": "array", "items": {"type": "integer"}},
                   {"type": "array", "items": {"type": "string", "enum": ["x", "y"]}}, [3], ["x"]),
         "text": ({"type": "string", "enum": ["a", "b"]}, {"type": "string", "enum": ["x", "y"]}, "a", "x")}
KIND = {"qwen3_coder": "array", "minimax_m2": "text", "minicpm5": "text"}


@pytest.mark.parametrize("parser", WRITERS)
def test_two_tools_defining_the_same_name_differently_each_get_their_own(compiler, parser):
    first, second, a, b = ITEMS[KIND.get(parser, "scalar")]
    this = case(parser, [ToolSpec("count", with_item(first)), ToolSpec("pick", with_item(second))])
    calls = grammar(this, parallel=False)
    for calls_, good in (([("count", {"n": a})], True), ([("pick", {"n": b})], True),
                         ([("count", {"n": b})], False), ([("pick", {"n": a})], False)):
        text = this.write(calls_)
        assert accepts(compiler, calls, text) == good, text
        assert reads_back_valid(this, calls_) == good, text


@pytest.mark.parametrize("parser, kind", [("qwen3_coder", "scalar"), ("minimax_m2", "array"), ("minicpm5", "scalar")])
def test_a_ref_parameter_a_typed_parser_would_read_as_another_kind_is_left_free(parser, kind):
    """Its parser reads the value as text (or JSON) whatever the definition says: refused, so
    the server leaves the tools free rather than enforce what would read back wrong."""
    first, second, _, _ = ITEMS[kind]
    with pytest.raises(UnsupportedTools, match="tool 'count', parameter 'n': .* only a \\$ref"):
        grammar(case(parser, [ToolSpec("count", with_item(first)), ToolSpec("pick", with_item(second))]), False)


NODE = {"type": "object", "properties": {
    "v": {"type": "integer"}, "label": {"$ref": "#/definitions/Label"},
    "kids": {"type": "array", "items": {"$ref": "#/definitions/Node"}}}, "required": ["v"]}
TREE = ToolSpec("tree", {"type": "object", "properties": {"root": {"$ref": "#/definitions/Node"}}, "required": ["root"],
                         "definitions": {"Node": NODE, "Label": {"type": "string"}}})
FLAT_ONLY = ("minimax_m2", "minicpm5", "function_gemma")  # no object read back from a $ref parameter
QUICK = ("json_tools", "qwen3_coder", "gemma4")  # one JSON body, one typed argument, one written per schema


@pytest.mark.parametrize("parser", [p if p in QUICK else pytest.param(p, marks=pytest.mark.slow) for p in WRITERS])
def test_a_recursive_definition_is_enforced_at_every_depth(compiler, parser):
    this = case(parser, [TREE])
    if parser in FLAT_ONLY:
        with pytest.raises(UnsupportedTools, match="tool 'tree', parameter 'root'"):
            grammar(this, parallel=False)
        return
    calls = grammar(this, parallel=False)
    good = {"v": 1, "kids": [{"v": 2, "label": "leaf <b>", "kids": [{"v": 3}]}]}
    bad = [{"v": 1, "kids": [{"v": 2, "kids": [{"label": "no v"}]}]},  # v is required two levels down
           {"v": 1, "kids": [{"v": 2, "label": 7}]}]
    if this.marker:  # a string reached through two refs may not hold the closing marker
        bad.append({"v": 1, "kids": [{"v": 2, "label": f"a{this.marker}b"}]})
    for root, ok in [(good, True)] + [(b, False) for b in bad]:
        text = this.write([("tree", {"root": root})])
        assert accepts(compiler, calls, text) == ok, text
        assert reads_back_valid(this, [("tree", {"root": root})]) == ok, text


BAD_REFS = [("https://example.com/item.json", "points outside the tool's schema"),
            ("#/$defs/Missing", "does not resolve"), ("#Item", "does not resolve"),
            ("#/properties/n/type", "does not point to a schema")]


@pytest.mark.parametrize("parser", FORMATS)
def test_a_ref_that_leads_nowhere_is_an_error_naming_the_tool(parser):
    for ref, says in BAD_REFS:
        schema = {"type": "object", "properties": {"n": {"type": "integer"}, "m": {"$ref": ref}}}
        with pytest.raises(BadToolSchema, match=re.escape(f"tool 'broken': $ref '{ref}' {says}")):
            tool_call_grammar("<tool_call>", "</tool_call>", [ToolSpec("fine", with_item({"type": "integer"})),
                                                              ToolSpec("broken", schema)],
                              allow_text=False, parser=parser)
