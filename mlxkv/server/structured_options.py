"""A request's structured-output fields, per API, as the one Grammar its reply must match.

- OpenAI chat: `response_format` json_object / json_schema; function tools
  with `strict: true`; `tool_choice` "required" or a named function.
- Responses: `text.format` of the same kinds; its tools and tool_choice.
- Anthropic: `tool_choice` any / tool (the tools' input_schema enforced);
  `output_format` json_schema.
- Every API: mlxkv's own `grammar` (extra_body): Lark text, or
  {"type": "lark" | "regex" | "json_schema", "value": ...}.

Precedence when several are sent: `grammar`, then a forced tool call, then
the reply format, then `auto` with strict tools (text, or a valid call).
A grammar llguidance cannot compile is a 400 naming the failing part.
Tool calls are enforced in the model's own format where mlxkv writes a
grammar for mlx-lm's parser of it (tool_grammar.py FORMATS); for other
formats, or schemas a format cannot carry exactly, the tools are left free,
with a warning. Several calls in one reply unless the request turns
parallel calls off (`parallel_tool_calls: false`; Anthropic's
`disable_parallel_tool_use`).
"""

from __future__ import annotations

import logging
from typing import Any

from mlxkv.errors import MlxkvError
from mlxkv.models.compat import added_token_id, tool_parser_name
from mlxkv.server.api_errors import ApiError
from mlxkv.structured.compiler import check_grammar
from mlxkv.structured.grammar import Grammar
from mlxkv.structured.tool_grammar import FORMATS, TAGS, ToolSpec, UnsupportedTools, tool_call_grammar

log = logging.getLogger(__name__)


def chat_grammar(body, tokenizer) -> Grammar | None:
    """OpenAI chat completions (and completions: their `grammar` alone)."""
    tools = [_openai_tool(t.get("function") or {}) for t in getattr(body, "tools", None) or []
             if t.get("type", "function") == "function"]
    choice = _openai_choice(getattr(body, "tool_choice", None), nested=True)
    fmt = _reply_format(getattr(body, "response_format", None), "response_format")
    parallel = getattr(body, "parallel_tool_calls", None) is not False  # OpenAI's default: true
    return _choose(body.grammar, tools, choice, fmt, tokenizer, parallel)


def responses_grammar(body, tokenizer) -> Grammar | None:
    tools = [_openai_tool(t) for t in body.tools or [] if t.get("type") == "function"]
    text = body.text if isinstance(body.text, dict) else {}
    return _choose(body.grammar, tools, _openai_choice(body.tool_choice, nested=False),
                   _reply_format(text.get("format"), "text.format", flat=True), tokenizer,
                   body.parallel_tool_calls is not False)


def anthropic_grammar(body, tokenizer) -> Grammar | None:
    tools = [(ToolSpec(t.name, t.input_schema or None), bool(getattr(t, "strict", False))) for t in body.tools or []]
    choice = body.tool_choice or {}
    kind = choice.get("type", "auto")
    mode = {"any": ("required", None), "tool": ("required", choice.get("name")),
            "none": ("none", None)}.get(kind, ("auto", None))
    fmt, param = _anthropic_format(body)
    return _choose(body.grammar, tools, mode, _reply_format(fmt, param, flat=True), tokenizer,
                   not choice.get("disable_parallel_tool_use", False))


def _anthropic_format(body) -> tuple[Any, str]:
    """The reply format: `output_config.format` (the API's), or `output_format` (its beta's)."""
    config = body.output_config
    if config is not None and not isinstance(config, dict):
        raise ApiError(400, f"output_config: expected an object, got {config!r}", param="output_config")
    fmt = (config or {}).get("format")
    if fmt is not None and body.output_format is not None and fmt != body.output_format:
        raise ApiError(400, "output_config.format and output_format differ: send one",
                       param="output_config.format")
    return (fmt, "output_config.format") if fmt is not None else (body.output_format, "output_format")


def _openai_tool(function: dict) -> tuple[ToolSpec, bool]:
    """(the tool, whether it is strict) of a chat function or a Responses function tool."""
    name = function.get("name")
    if not name:
        raise ApiError(400, "tools: a function tool needs a name", param="tools")
    return ToolSpec(name, function.get("parameters") or None), bool(function.get("strict"))


def _openai_choice(choice: Any, nested: bool) -> tuple[str, str | None]:
    if choice in (None, "auto"):
        return "auto", None
    if choice in ("none", "required"):
        return choice, None
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name") if nested else choice.get("name")
        if name is None and nested:
            name = choice.get("name")  # the Responses shape sent to chat: read it too
        if not name:
            raise ApiError(400, "tool_choice: a function choice needs its name", param="tool_choice")
        return "required", name
    raise ApiError(400, f"tool_choice: expected none, auto, required or a function, got {choice!r}",
                   param="tool_choice")


def _reply_format(fmt: Any, param: str, flat: bool = False) -> Grammar | None:
    """json_object / json_schema, in chat's shape ({"json_schema": {"schema"}}) or the flat one
    (Responses' text.format, Anthropic's output_format: {"schema"} beside "type")."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise ApiError(400, f"{param}: expected an object, got {fmt!r}", param=param)
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return Grammar.json_object()
    if kind == "json_schema":
        spec = fmt if flat else fmt.get("json_schema") or {}
        schema = spec.get("schema")
        if schema is None:
            raise ApiError(400, f"{param}: a json_schema format needs its schema", param=param)
        return _checked(lambda: Grammar.json_schema(schema), param)
    raise ApiError(400, f"{param}: unknown type {kind!r} (text, json_object or json_schema)", param=param)


def _grammar_field(value: Any) -> Grammar | None:
    if value is None:
        return None
    if isinstance(value, str):
        return _checked(lambda: Grammar.lark(value), "grammar")
    if isinstance(value, dict) and value.get("type") in ("lark", "regex", "json_schema"):
        kind, source = value["type"], value.get("value")
        make = {"lark": Grammar.lark, "regex": Grammar.regex, "json_schema": Grammar.json_schema}[kind]
        return _checked(lambda: make(source), "grammar")
    raise ApiError(400, 'grammar: Lark text, or {"type": "lark" | "regex" | "json_schema", "value": ...}',
                   param="grammar")


def _choose(grammar: Any, tools: list[tuple[ToolSpec, bool]], choice: tuple[str, str | None],
            reply_format: Grammar | None, tokenizer, parallel: bool) -> Grammar | None:
    """The request's one grammar by the precedence above, checked (400 if it does not compile).
    `tools`: (tool, strict) each; a forced call enforces every tool's schema, `auto` the strict ones'.
    `parallel`: the request allows several calls in one reply."""
    explicit = _grammar_field(grammar)
    if explicit is not None:
        return explicit
    specs = [spec for spec, _ in tools]
    mode, name = choice
    if mode == "required" and specs:
        forced = [t for t in specs if name is None or t.name == name]
        if not forced:
            raise ApiError(400, f"tool_choice: no tool named {name!r} among the tools", param="tool_choice")
        call = _tool_grammar(tokenizer, forced, allow_text=False, parallel=parallel)
        if call is not None:
            return call
    if reply_format is not None:
        return reply_format
    if mode == "auto" and any(strict for _, strict in tools):
        return _tool_grammar(tokenizer, [spec if strict else ToolSpec(spec.name, None) for spec, strict in tools],
                             allow_text=True, parallel=parallel)
    return None


def _tool_grammar(tokenizer, tools: list[ToolSpec], allow_text: bool, parallel: bool) -> Grammar | None:
    parser = tool_parser_name(tokenizer)
    if parser not in FORMATS:
        log.warning("tool calls are not enforced for this model: its tool-call format (%s) is not one "
                    "mlxkv writes grammars for (%s)", parser or "none", ", ".join(FORMATS))
        return None
    start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
    ids = (added_token_id(tokenizer, start), added_token_id(tokenizer, end))
    tags = {tag: added_token_id(tokenizer, tag) for tag in TAGS.get(parser, ())}
    try:
        grammar = tool_call_grammar(start, end, tools, allow_text, ids, parser, parallel,
                                    {tag: i for tag, i in tags.items() if i is not None})
    except UnsupportedTools as e:
        log.warning("tool calls are not enforced for this request: %s", e)
        return None
    except MlxkvError as e:  # a schema that is wrong in itself (a $ref that does not resolve)
        raise ApiError(400, f"tools: {e}", param="tools") from None
    return _checked(lambda: grammar, "tools")


def _checked(make, param: str) -> Grammar:
    try:
        grammar = make()
        check_grammar(grammar)
    except MlxkvError as e:
        raise ApiError(400, f"{param}: {e}", param=param) from None
    return grammar
