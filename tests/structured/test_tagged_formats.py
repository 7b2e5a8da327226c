"""The newer mlx-lm tool-call formats, table-driven, with mlx-lm's own parser (through the
server's splitter, as a reply is read) as the oracle: calls the grammar accepts read back as
exactly the calls written, valid against their schemas; texts it refuses would not (a value
with the format's closing marker in it among them: the parser would cut the call there)."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from typing import Callable

import jsonschema
import pytest

from mlxkv.server.tool_calls import ToolCallSplitter
from mlxkv.structured.tool_grammar import ToolSpec, tool_call_grammar
from test_tool_formats import SCHEMA, TOOLS, accepts

FLAT = {**SCHEMA, "properties": {k: v for k, v in SCHEMA["properties"].items() if k != "tags"}}
FLAT_TOOLS = [ToolSpec("edit", FLAT), TOOLS[1]]


def _text(v) -> str:  # the typed formats' text of a value
    return v if isinstance(v, str) else json.dumps(v)


def _attrs(calls, invoke, param, value=_text, tail="") -> str:
    return "".join(invoke.format(n=n) + "".join(param.format(k=k, v=value(v)) for k, v in a.items()) + tail
                   for n, a in calls)


def minimax(calls):
    body = "".join(f'<invoke name="{n}">\n' + "".join(f'<parameter name="{k}">{_text(v)}</parameter>\n'
                                                      for k, v in a.items()) + "</invoke>\n" for n, a in calls)
    return f"<minimax:tool_call>\n{body}</minimax:tool_call>"


def minicpm(calls):
    return "\n".join(f'<function name="{n}">' + "".join(f'<param name="{k}">{_text(v)}</param>' for k, v in a.items())
                     + "</function>" for n, a in calls)


def muse(calls):
    return "<atem:function_calls>" + "".join(
        f'<atem:invoke name="{n}">' + "".join(f'<atem:parameter name="{k}">{json.dumps(v, ensure_ascii=False)}'
                                              f"</atem:parameter>" for k, v in a.items()) + "</atem:invoke>"
        for n, a in calls) + "</atem:function_calls>"


def kimi_k3(calls):
    def argument(k, v):
        kind = "string" if isinstance(v, str) else SCHEMA["properties"].get(k, {}).get("type", "json")
        value = v if isinstance(v, str) else json.dumps(v)
        return f'<|open|>argument key="{k}" type="{kind}"<|sep|>{value}<|close|>argument<|sep|>'
    body = "".join(f'<|open|>call tool="{n}" index="{i}"<|sep|>' + "".join(argument(k, v) for k, v in a.items())
                   + "<|close|>call<|sep|>" for i, (n, a) in enumerate(calls))
    return f"<|open|>tools<|sep|>{body}<|close|>tools<|sep|>"


def function_gemma(calls):
    def value(v):
        return f"<escape>{v}<escape>" if isinstance(v, str) else json.dumps(v)
    return "\n".join("<start_function_call>call:" + n + "{" + ",".join(f"{k}:{value(v)}" for k, v in a.items())
                     + "}<end_function_call>" for n, a in calls)


def gemma4(calls):
    def value(v):
        if isinstance(v, str):
            return f'<|"|>{v}<|"|>'
        if isinstance(v, list):
            return "[" + ",".join(value(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ",".join(f"{k}:{value(x)}" for k, x in v.items()) + "}"
        return json.dumps(v)
    return "\n".join(f"<|tool_call>call:{n}{value(a)}<tool_call|>" for n, a in calls)


def mistral(calls):
    return "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a, ensure_ascii=False)}" for n, a in calls)


def longcat(calls):
    def one(n, a):
        if not a:
            return f'<longcat_tool_call>{{"name": "{n}", "arguments": {{}}}}</longcat_tool_call>'
        return f"<longcat_tool_call>{n}" + "".join(
            f"<longcat_arg_key>{k}</longcat_arg_key><longcat_arg_value>{_text(v)}</longcat_arg_value>"
            for k, v in a.items()) + "</longcat_tool_call>"
    return "\n".join(one(n, a) for n, a in calls)


def laguna(calls):  # GLM-4.7's format: its parser is glm47's
    return "\n".join(f"<tool_call>{n}" + "".join(f"<arg_key>{k}</arg_key><arg_value>{_text(v)}</arg_value>"
                                                 for k, v in a.items()) + "</tool_call>" for n, a in calls)


EDIT = ("edit", {"path": "a.py", "count": 3})
FULL = ("edit", {"path": "line one\n  <b>two</b> é", "count": -12, "ratio": 0.5, "force": False, "mode": "w",
                 "tags": ["x", "y z"]})
NOOP = ("noop", {})
GOOD = [[EDIT], [FULL], [NOOP], [EDIT, NOOP], [("edit", {"path": "", "count": 0, "ratio": 2})]]


@dataclass
class Case:
    parser: str
    write: Callable[[list], str]
    marker: str  # a closing marker a string value could hold ("" : none could cut the call)
    tools: list = field(default_factory=lambda: TOOLS)
    bad: list[str] = field(default_factory=list)  # texts of this format's own the grammar refuses


CASES = [
    Case("minimax_m2", minimax, "</parameter>",
         bad=[minimax([("edit", {"path": "null", "count": 1})]), minimax([("edit", {"path": " a.py", "count": 1})])]),
    Case("minicpm5", minicpm, "</param>", bad=[minicpm([("edit", {"path": "<![CDATA[a]]>", "count": 1})])]),
    Case("muse_spark", muse, "</atem:parameter>", bad=[muse([("edit", {"path": "a", "count": "1"})])]),
    Case("kimi_k3", kimi_k3, "<|close|>call<|sep|>",
         bad=[kimi_k3([EDIT]).replace('type="integer"', 'type="string"')]),
    Case("function_gemma", function_gemma, "}", tools=[ToolSpec("edit", FLAT), TOOLS[1]]),
    Case("gemma4", gemma4, '<|"|>'),
    Case("mistral", mistral, ""),
    Case("longcat", longcat, "</longcat_arg_value>",
         bad=[longcat([("edit", {"path": " a.py", "count": 1})]), "<longcat_tool_call>noop</longcat_tool_call>"]),
    Case("laguna", laguna, "</arg_value>"),
]


def openai_tools(tools):
    return [{"type": "function", "function": {"name": t.name, "parameters": t.schema}} for t in tools]


def read_back(case: Case, text: str) -> list:
    """The calls mlx-lm's parser reads from `text`, split from the reply as the server does."""
    module = importlib.import_module(f"mlx_lm.tool_parsers.{case.parser}")
    splitter = ToolCallSplitter(module.tool_call_start, module.tool_call_end, module.parse_tool_call,
                                openai_tools(case.tools))
    content, calls = splitter.feed(text)
    calls += splitter.finish()[1]
    return [(c.name, json.loads(c.arguments)) for c in calls]


def reads_back_valid(case: Case, calls: list) -> bool:
    try:
        got = read_back(case, case.write(calls))
    except Exception:
        return False
    schemas = {t.name: t.schema for t in case.tools}
    return got == [tuple(c) for c in calls] and all(
        n in schemas and jsonschema.Draft202012Validator(schemas[n]).is_valid(a) for n, a in got)


def grammar(case: Case, parallel: bool, allow_text: bool = False):
    module = importlib.import_module(f"mlx_lm.tool_parsers.{case.parser}")
    parser = "glm47" if case.parser == "laguna" else case.parser  # mlx-lm's laguna is glm47's parser
    return tool_call_grammar(module.tool_call_start, module.tool_call_end, case.tools, allow_text=allow_text,
                             parser=parser, parallel=parallel)


def flat(calls):  # function_gemma has no arrays
    return [(n, {k: v for k, v in a.items() if k != "tags"}) for n, a in calls]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.parser)
def test_calls_the_grammar_accepts_read_back_valid_and_the_rest_would_not(compiler, case):
    good = [flat(c) if case.parser == "function_gemma" else c for c in GOOD]
    parallel, single = grammar(case, parallel=True), grammar(case, parallel=False)
    for calls in good:
        text = case.write(calls)
        assert accepts(compiler, parallel, text), text
        assert accepts(compiler, single, text) == (len(calls) == 1), text
        assert reads_back_valid(case, calls), text
    assert accepts(compiler, grammar(case, parallel=False, allow_text=True), "Sure. " + case.write([EDIT]))
    bad = [[("edit", {"path": "a.py"})],  # count is required
           [("edit", {"path": "a.py", "count": "1.5"})],
           [("edit", {"path": "a.py", "count": 1.5})],
           [("edit", {"path": "a.py", "count": 1, "mode": "x"})],
           [("other", {})]]
    if case.marker:  # a string holding the closing marker: the parser would cut the call there
        bad.append([("edit", {"path": f"a{case.marker}b", "count": 1})])
        if case.parser != "function_gemma":  # and inside a JSON value's string
            bad.append([("edit", {"path": "a", "count": 1, "tags": [f"x{case.marker}"]})])
    for calls in bad:
        text = case.write(calls)
        assert not accepts(compiler, parallel, text), text
        assert not reads_back_valid(case, calls), text
    for text in case.bad:
        assert not accepts(compiler, parallel, text), text


@pytest.fixture(scope="module")
def tagged(llama_dir):
    """A tokenizer whose markers and inner tags are added tokens, as the models' own are, and its compiler."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    from mlxkv.structured.compiler import GrammarCompiler
    from mlxkv.structured.tool_grammar import TAGS

    base = Tokenizer.from_file(f"{llama_dir}/tokenizer.json")
    marks = ["<minimax:tool_call>", "</minimax:tool_call>", "[TOOL_CALLS]", "<start_function_call>",
             "<end_function_call>", "<|tool_call>", "<tool_call|>", *(t for c in CASES for t in TAGS.get(c.parser, ()))]
    base.add_tokens([AddedToken(m, special=True, normalized=False) for m in dict.fromkeys(marks)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=base)
    return tokenizer, GrammarCompiler(tokenizer, len(tokenizer), [0])


TOKEN_TAGGED = ("minimax_m2", "kimi_k3", "function_gemma", "gemma4", "mistral", "longcat")


@pytest.mark.slow  # a second tokenizer and compiler: ~0.5 s
@pytest.mark.parametrize("case", [c for c in CASES if c.parser in TOKEN_TAGGED], ids=lambda c: c.parser)
def test_a_chat_request_s_forced_call_writes_the_tags_the_tokenizer_has_as_tokens(tagged, case):
    """Through the server's own choice of grammar (chat_grammar): a marker or tag that is one added
    token is written as that token (as text the model would have to spell it byte by byte)."""
    from types import SimpleNamespace

    from mlxkv.server.structured_options import chat_grammar

    tokenizer, compiler = tagged
    module = importlib.import_module(f"mlx_lm.tool_parsers.{case.parser}")
    model = SimpleNamespace(has_tool_calling=True, tool_parser=module.parse_tool_call,
                            tool_call_start=module.tool_call_start, tool_call_end=module.tool_call_end,
                            added_tokens_decoder=tokenizer.added_tokens_decoder)
    body = SimpleNamespace(grammar=None, tools=openai_tools(case.tools), tool_choice="required",
                           response_format=None, parallel_tool_calls=True)
    grammar = chat_grammar(body, model)
    added = set(tokenizer.added_tokens_decoder)
    for calls in ([EDIT], [EDIT, NOOP]):
        tokens = tokenizer.encode(case.write(calls), add_special_tokens=False)
        assert added & set(tokens)  # the text's tags are the model's tokens
        matcher = compiler.matcher(grammar)
        assert matcher.valid_prefix(tokens) == len(tokens)
        matcher.advance(tokens)
        assert matcher.accepting, case.write(calls)


def test_every_tool_parser_of_the_installed_mlx_lm_has_a_grammar():
    """A parser mlx-lm adds fails here, not as a model whose calls silently stay free."""
    import pkgutil
    from types import SimpleNamespace

    import mlx_lm.tool_parsers

    from mlxkv.models.compat import tool_parser_name
    from mlxkv.structured.tool_grammar import FORMATS

    names = [m.name for m in pkgutil.iter_modules(mlx_lm.tool_parsers.__path__)]
    assert len(names) >= 14
    for name in names:
        module = importlib.import_module(f"mlx_lm.tool_parsers.{name}")
        model = SimpleNamespace(has_tool_calling=True, tool_parser=module.parse_tool_call)
        assert tool_parser_name(model) in FORMATS, name


@pytest.mark.slow  # ~0.1 s a format
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.parser)
def test_a_tool_without_a_schema_takes_any_arguments_in_each_format(compiler, case):
    case = Case(case.parser, case.write, case.marker, tools=[ToolSpec("free", None)])
    text = case.write([("free", {"q": "any text", "n": "two words"})])
    assert accepts(compiler, grammar(case, parallel=False, allow_text=True), "Sure. " + text), text
    assert read_back(case, text) == [("free", {"q": "any text", "n": "two words"})]
    assert not accepts(compiler, grammar(case, parallel=False), case.write([("other", {"q": "x"})]))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.parser)
def test_a_property_whose_schema_is_true_or_false_never_crashes(case):
    """A grammar, or a clear MlxkvError (UnsupportedTools: the tools left free; else a 400):
    never another exception (a 500)."""
    from mlxkv.errors import MlxkvError

    for schema in (True, False):
        tool = ToolSpec("t", {"type": "object", "properties": {"p": schema}})
        try:
            grammar(Case(case.parser, case.write, case.marker, [tool]), parallel=False)
        except MlxkvError:
            pass
