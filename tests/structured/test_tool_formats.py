"""Tool-call grammars per mlx-lm call format, with mlx-lm's own parser as the oracle: a
call the grammar accepts parses into a tool and arguments valid against its schema; calls
it rejects are the ones that would not."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from mlxkv.structured.tool_grammar import ToolSpec, UnsupportedTools, tool_call_grammar

SCHEMA = {"type": "object", "properties": {
    "path": {"type": "string", "description": "where"}, "count": {"type": "integer"},
    "ratio": {"type": "number"}, "force": {"type": "boolean"},
    "mode": {"type": "string", "enum": ["r", "w"]},
    "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["path", "count"]}
TOOLS = [ToolSpec("edit", SCHEMA), ToolSpec("noop", {"type": "object", "properties": {}})]
OPENAI_TOOLS = [{"type": "function", "function": {"name": t.name, "parameters": t.schema}} for t in TOOLS]


def accepts(compiler, grammar, text: str) -> bool:
    """The whole of `text` is a complete reply of `grammar`."""
    ids = compiler._hf.encode(text, add_special_tokens=False)
    matcher = compiler.matcher(grammar)
    if matcher.valid_prefix(ids) != len(ids):
        return False
    matcher.advance(ids)
    return matcher.accepting


def xml_call(name: str, **params) -> str:
    args = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{args}</function>\n</tool_call>"


def parse_xml(text: str) -> dict:
    from mlx_lm.tool_parsers import qwen3_coder

    body = text.removeprefix("<tool_call>").removesuffix("</tool_call>")
    return qwen3_coder.parse_tool_call(body, OPENAI_TOOLS)


def valid(call: dict) -> bool:
    schema = {t.name: t.schema for t in TOOLS}.get(call["name"])
    return schema is not None and jsonschema.Draft202012Validator(schema).is_valid(call["arguments"])


XML_GOOD = [xml_call("edit", path="a.py", count=3),
            xml_call("edit", path="line one\n  <b>two</b>\n", count=-12, ratio="0.5", force="false", mode="w",
                     tags='["x", "y"]'),
            xml_call("edit", path="", count=0, ratio=7),
            xml_call("noop")]
XML_BAD = [xml_call("edit", path="a.py"),  # count is required
           xml_call("edit", path="a.py", count="1.5"),
           xml_call("edit", path="null", count=1),  # the parser reads "null" as None
           xml_call("edit", path="a.py", count=1, force="yes"),  # the parser would read False
           xml_call("edit", path="a.py", count=1, mode="x"),
           xml_call("edit", path="a.py", count=1, tags="[1]"),
           xml_call("edit", path="a</parameter>", count=1),
           xml_call("other")]


def test_qwen3_coder_calls_the_grammar_accepts_parse_valid_and_the_rest_do_not(compiler):
    grammar = tool_call_grammar("<tool_call>", "</tool_call>", TOOLS, allow_text=False, parser="qwen3_coder")
    for text in XML_GOOD:
        assert accepts(compiler, grammar, text), text
        assert valid(parse_xml(text)), text
    for text in XML_BAD:
        assert not accepts(compiler, grammar, text), text


def test_qwen3_coder_random_arguments_the_grammar_accepts_read_back_as_written(compiler):
    """Random argument values (text with markup, newlines and "null" in it; numbers; flags):
    each call the grammar accepts, the parser reads back as exactly those arguments."""
    grammar = tool_call_grammar("<tool_call>", "</tool_call>", TOOLS, allow_text=False, parser="qwen3_coder")
    rng = random.Random(7)
    pieces = ["a", " ", "\n", "<", ">", "/", "null", "</param", "<parameter=x>", "é", "{", "1"]
    for _ in range(12):
        args = {"path": "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 8))),
                "count": rng.randrange(-10**14, 10**14), "ratio": rng.choice([0.25, -3.5, 2]),
                "force": rng.choice([True, False]), "mode": rng.choice(["r", "w"]), "tags": ["x", "y z"]}
        args = {k: v for k, v in args.items() if k in ("path", "count") or rng.random() < 0.5}
        shown = {k: json.dumps(v) if k == "tags" else str(v).lower() if k == "force" else v
                 for k, v in args.items()}
        text = xml_call("edit", **shown)
        assert accepts(compiler, grammar, text), text
        assert parse_xml(text) == {"name": "edit", "arguments": args}, text


def test_parallel_calls_only_when_allowed(compiler):
    two = XML_GOOD[0] + "\n" + XML_GOOD[3]
    for parallel in (False, True):
        grammar = tool_call_grammar("<tool_call>", "</tool_call>", TOOLS, allow_text=False, parser="qwen3_coder",
                                    parallel=parallel)
        assert accepts(compiler, grammar, XML_GOOD[0])
        assert accepts(compiler, grammar, two) == parallel
        grammar = tool_call_grammar("<tool_call>", "</tool_call>", TOOLS, allow_text=True, parser="qwen3_coder",
                                    parallel=parallel)
        assert accepts(compiler, grammar, "Let me look. " + two) == parallel
    json_call = '<tool_call>{"name": "noop", "arguments": {}}</tool_call>'
    for parallel in (False, True):
        grammar = tool_call_grammar("<tool_call>", "</tool_call>", TOOLS, allow_text=False, parallel=parallel)
        assert accepts(compiler, grammar, json_call)
        assert accepts(compiler, grammar, json_call + "\n" + json_call) == parallel


def test_qwen3_coder_schemas_it_cannot_write_exactly_are_refused():
    for prop in ({"type": "string", "pattern": "a+"}, {"type": "integer", "minimum": 1},
                 {"type": ["string", "null"]}, {"anyOf": [{"type": "string"}]}):
        tool = ToolSpec("t", {"type": "object", "properties": {"p": prop}})
        with pytest.raises(UnsupportedTools):
            tool_call_grammar("<tool_call>", "</tool_call>", [tool], allow_text=False, parser="qwen3_coder")
    pattern = ToolSpec("t", {"type": "object", "properties": {"p": {"type": "string", "pattern": "a+"}}})
    with pytest.raises(UnsupportedTools):
        tool_call_grammar("<tool_call>", "</tool_call>", [pattern], allow_text=False, parser="glm47")
    with pytest.raises(UnsupportedTools):
        tool_call_grammar("[TOOL_CALLS]", "", TOOLS, allow_text=False, parser="no_such_format")


def glm_call(name: str, **params) -> str:
    args = "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in params.items())
    return f"<tool_call>{name}{args}</tool_call>"


def parse_glm(text: str) -> dict:
    from mlx_lm.tool_parsers import glm47

    return glm47.parse_tool_call(text.removeprefix("<tool_call>").removesuffix("</tool_call>"), OPENAI_TOOLS)


GLM_GOOD = [glm_call("edit", path="a.py", count=3),
            glm_call("edit", path="line one\n  <b>two</b>", count=-12, ratio="0.5", force="false", mode="w",
                     tags='["x", "y"]'),
            glm_call("edit", path="null", count=0, ratio="7"),  # a string property keeps its text
            glm_call("edit", path="", count=1),
            glm_call("noop")]
GLM_BAD = [glm_call("edit", path="a.py"),  # count is required
           glm_call("edit", path="a.py", count="1.5"),
           glm_call("edit", path="a.py", count='"3"'),
           glm_call("edit", path=" a.py", count=1),  # the parser would strip the space
           glm_call("edit", path="a.py\n", count=1),
           glm_call("edit", path="a.py", count=1, force="yes"),
           glm_call("edit", path="a.py", count=1, mode="x"),
           glm_call("edit", path="a.py", count=1, tags="[1]"),
           glm_call("edit", path="a</arg_value>", count=1),
           glm_call("other")]


def test_glm47_calls_the_grammar_accepts_parse_valid_and_the_rest_do_not(compiler):
    grammar = tool_call_grammar("<tool_call>", "</tool_call>", TOOLS, allow_text=False, parser="glm47")
    for text in GLM_GOOD:
        assert accepts(compiler, grammar, text), text
        assert valid(parse_glm(text)), text
    for text in GLM_BAD:
        assert not accepts(compiler, grammar, text), text
    rng = random.Random(11)
    pieces = ["a", " ", "\n", "<", ">", "/", "null", "</arg_val", "<arg_key>", "é", "{", "1"]
    for _ in range(12):  # random arguments: what the grammar accepts, the parser reads back as written
        args = {"path": "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 8))).strip(),
                "count": rng.randrange(-10**14, 10**14), "ratio": rng.choice([0.25, -3.5, 2]),
                "force": rng.choice([True, False]), "mode": rng.choice(["r", "w"]), "tags": ["x", "y z"]}
        args = {k: v for k, v in args.items() if k in ("path", "count") or rng.random() < 0.5}
        text = glm_call("edit", **{k: v if k in ("path", "mode") else json.dumps(v) for k, v in args.items()})
        assert accepts(compiler, grammar, text), text
        assert parse_glm(text) == {"name": "edit", "arguments": args}, text


def test_a_tool_without_a_schema_takes_any_arguments(compiler):
    for parser, write in (("qwen3_coder", xml_call), ("glm47", glm_call), ("pythonic", py_call)):
        pythonic = parser == "pythonic"
        start, end = ("<|tool_call_start|>", "<|tool_call_end|>") if pythonic else ("<tool_call>", "</tool_call>")
        grammar = tool_call_grammar(start, end, [ToolSpec("free", None)], allow_text=True, parser=parser)
        assert accepts(compiler, grammar, "Sure. " + write("free", q='"any text"', n="3")), parser
        assert not accepts(compiler, grammar, "Sure. " + write("other", q="x")), parser


def py_call(name: str, **params) -> str:
    args = ", ".join(f"{k}={v}" for k, v in params.items())
    return f"<|tool_call_start|>[{name}({args})]<|tool_call_end|>"


def parse_py(text: str) -> dict:
    from mlx_lm.tool_parsers import pythonic

    return pythonic.parse_tool_call(text.removeprefix("<|tool_call_start|>").removesuffix("<|tool_call_end|>"))


PY_GOOD = [py_call("edit", path='"a.py"', count=3),
           py_call("edit", path='"line \\"one\\"\\n\\t<b>two</b>)]"', count=-12, ratio=0.5, force="false", mode='"w"',
                   tags='["x", "y"]'),
           py_call("edit", path='""', count=0, tags="[]"),
           py_call("noop")]
PY_BAD = [py_call("edit", path='"a.py"'),  # count is required
          py_call("edit", count=3, path='"a.py"'),  # the schema's order
          py_call("edit", path='"a.py"', count=1.5),
          py_call("edit", path="'a.py'", count=1),
          py_call("edit", path='"a.py"', count=1, force="True"),
          py_call("edit", path='"a.py"', count=1, mode='"x"'),
          py_call("edit", path='"\\/"', count=1),
          py_call("edit", path='"a.py"', count=1, tags="[1]"),
          py_call("other")]


def test_pythonic_calls_the_grammar_accepts_parse_valid_and_the_rest_do_not(compiler):
    grammar = tool_call_grammar("<|tool_call_start|>", "<|tool_call_end|>", TOOLS, allow_text=False,
                                parser="pythonic")
    for text in PY_GOOD:
        assert accepts(compiler, grammar, text), text
        assert valid(parse_py(text)), text
    for text in PY_BAD:
        assert not accepts(compiler, grammar, text), text
    rng = random.Random(5)
    pieces = ["a", " ", "\n", "\t", '"', "'", "\\", ")]", "null", "é", "{", "1"]
    for _ in range(12):  # random arguments: what the grammar accepts, the parser reads back as written
        args = {"path": "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 8))),
                "count": rng.randrange(-10**18, 10**18), "ratio": rng.choice([0.25, -3.5, 2]),
                "force": rng.choice([True, False]), "mode": rng.choice(["r", "w"]), "tags": ["x", "y z"]}
        args = {k: v for k, v in args.items() if k in ("path", "count") or rng.random() < 0.5}
        text = py_call("edit", **{k: json.dumps(v, ensure_ascii=False) for k, v in args.items()})
        assert accepts(compiler, grammar, text), text
        assert parse_py(text) == {"name": "edit", "arguments": args}, text


def test_each_api_s_parallel_switch_reaches_the_grammar_in_the_model_s_format(compiler):
    from types import SimpleNamespace

    from mlx_lm.tool_parsers import qwen3_coder

    from mlxkv.server.structured_options import anthropic_grammar, chat_grammar

    tokenizer = SimpleNamespace(has_tool_calling=True, tool_parser=qwen3_coder.parse_tool_call,
                                tool_call_start="<tool_call>", tool_call_end="</tool_call>")
    two = XML_GOOD[0] + "\n" + XML_GOOD[3]
    for parallel in (None, True, False):
        chat = SimpleNamespace(grammar=None, tools=OPENAI_TOOLS, tool_choice="required", response_format=None,
                               parallel_tool_calls=parallel)
        assert accepts(compiler, chat_grammar(chat, tokenizer), two) == (parallel is not False)
    for disable in (False, True):
        anthropic = SimpleNamespace(
            grammar=None, tools=[SimpleNamespace(name=t.name, input_schema=t.schema, strict=False) for t in TOOLS],
            tool_choice={"type": "any", "disable_parallel_tool_use": disable}, output_config=None,
            output_format=None)
        grammar = anthropic_grammar(anthropic, tokenizer)
        assert accepts(compiler, grammar, XML_GOOD[0]) and accepts(compiler, grammar, two) == (not disable)
    pattern = {"type": "function", "function": {"name": "t", "parameters": {
        "type": "object", "properties": {"p": {"type": "string", "pattern": "a+"}}}}}
    chat = SimpleNamespace(grammar=None, tools=[pattern], tool_choice="required", response_format=None)
    assert chat_grammar(chat, tokenizer) is None  # left free (with a warning), not a 400


def test_glm47_tags_that_are_added_tokens_are_written_as_their_tokens(llama_dir):
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    from mlxkv.models.compat import added_token_id
    from mlxkv.structured.compiler import GrammarCompiler
    from mlxkv.structured.tool_grammar import TAGS

    base = Tokenizer.from_file(f"{llama_dir}/tokenizer.json")
    marks = ("<tool_call>", "</tool_call>", *TAGS["glm47"])
    base.add_tokens([AddedToken(m, special=True, normalized=False) for m in marks])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=base)  # GLM's kind: every tag one added token
    ids = {m: added_token_id(tokenizer, m) for m in marks}
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [0])
    grammar = tool_call_grammar("<tool_call>", "</tool_call>", TOOLS, allow_text=True,
                                token_ids=(ids["<tool_call>"], ids["</tool_call>"]), parser="glm47",
                                tags={t: ids[t] for t in TAGS["glm47"]})
    for text, good in [(t, True) for t in GLM_GOOD] + [(t, False) for t in GLM_BAD]:
        tokens = tokenizer.encode("Let me see. " + text, add_special_tokens=False)
        assert ids["<arg_key>"] in tokens or "noop" in text or "other" in text  # the model's tokens, not text
        matcher = compiler.matcher(grammar)
        whole = matcher.valid_prefix(tokens) == len(tokens)
        if whole:
            matcher.advance(tokens)
        assert (whole and matcher.accepting) == good, text


def kimi_call(*calls: tuple[str, int, dict]) -> str:
    body = "".join(f"<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>"
                   f"{json.dumps(args, ensure_ascii=False)}<|tool_call_end|>" for name, i, args in calls)
    return f"<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"


def test_kimi_k2_calls_in_one_section_parse_valid_with_the_tags_as_tokens_or_as_text(llama_dir):
    from mlx_lm.tool_parsers import kimi_k2
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    from mlxkv.models.compat import added_token_id
    from mlxkv.structured.compiler import GrammarCompiler
    from mlxkv.structured.tool_grammar import TAGS

    start, end = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    edit = ("edit", 0, {"path": "a <|x|>.py", "count": 2, "tags": ["t"]})
    good, two = kimi_call(edit), kimi_call(edit, ("noop", 1, {}))
    bad = [kimi_call(("edit", 0, {"path": "a"})), kimi_call(("other", 0, {})),
           kimi_call(("edit", 0, {"path": "a", "count": "2"}))]
    for as_tokens in (False, True):
        base = Tokenizer.from_file(f"{llama_dir}/tokenizer.json")
        if as_tokens:  # Kimi's kind: markers and tags are added tokens
            base.add_tokens([AddedToken(m, special=True, normalized=False) for m in (start, end, *TAGS["kimi_k2"])])
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=base)
        compiler = GrammarCompiler(tokenizer, len(tokenizer), [0])
        tags = {t: i for t in TAGS["kimi_k2"] if (i := added_token_id(tokenizer, t)) is not None}
        assert len(tags) == (3 if as_tokens else 0)
        for parallel in (False, True):
            grammar = tool_call_grammar(start, end, TOOLS, allow_text=True, parser="kimi_k2", parallel=parallel,
                                        token_ids=(added_token_id(tokenizer, start), added_token_id(tokenizer, end)),
                                        tags=tags)
            assert accepts(compiler, grammar, "Sure. " + good) and accepts(compiler, grammar, two) == parallel
            assert not any(accepts(compiler, grammar, text) for text in bad)
        for text in (good, two):
            calls = kimi_k2.parse_tool_call(text.removeprefix(start).removesuffix(end))
            assert [c["name"] for c in calls] == ["edit", "noop"][:len(calls)] and all(valid(c) for c in calls)


# A call whose JSON value's string holds its format's closing marker, per format: its parser
# (through the server's splitter) would cut the call there.
MARKED = [("json_tools", "<tool_call>", "</tool_call>",
           '<tool_call>{"name": "edit", "arguments": {"path": "a%s", "count": 1}}</tool_call>', "</tool_call>"),
          ("qwen3_coder", "<tool_call>", "</tool_call>", xml_call("edit", path="a", count=1, tags='["x%s"]'),
           "</parameter>"),
          ("glm47", "<tool_call>", "</tool_call>", glm_call("edit", path="a", count=1, tags='["x%s"]'),
           "</arg_value>"),
          ("pythonic", "<|tool_call_start|>", "<|tool_call_end|>", py_call("edit", path='"a%s"', count=1),
           "<|tool_call_end|>"),
          ("kimi_k2", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
           kimi_call(("edit", 0, {"path": "a%s", "count": 1})), "<|tool_call_end|>")]


@pytest.mark.parametrize("parser, start, end, text, marker", MARKED, ids=[m[0] for m in MARKED])
def test_a_json_string_holding_the_closing_marker_is_refused(compiler, parser, start, end, text, marker):
    from mlx_lm.tool_parsers import glm47, json_tools, kimi_k2, pythonic, qwen3_coder

    from mlxkv.server.tool_calls import ToolCallSplitter

    module = {"json_tools": json_tools, "qwen3_coder": qwen3_coder, "glm47": glm47, "pythonic": pythonic,
              "kimi_k2": kimi_k2}[parser]
    grammar = tool_call_grammar(start, end, TOOLS, allow_text=False, parser=parser)
    for held, refused in (("<b>", False), (marker, True)):
        call = text.replace("%s", held)
        assert accepts(compiler, grammar, call) != refused, call
        splitter = ToolCallSplitter(start, end, module.parse_tool_call, OPENAI_TOOLS)
        calls = splitter.feed(call)[1] + splitter.finish()[1]
        read = [c.input() for c in calls]  # {} where the arguments are not JSON
        assert (len(read) == 1 and held in json.dumps(read[0], ensure_ascii=False)) != refused, read


def test_the_regex_excluding_a_marker_matches_exactly_the_texts_without_it():
    import re

    from mlxkv.structured.json_strings import excluding

    rng = random.Random(3)
    for marker in ("</tool_call>", "<|tool_call_end|>", "<escape>", "</a"):
        pattern, alphabet = re.compile(excluding(marker)), [*set(marker), "x", "\n"]
        for _ in range(1000):
            text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(12)))
            text = text[:4] + marker + text[4:] if rng.random() < 0.2 else text
            assert (pattern.fullmatch(text) is not None) == (marker not in text), (marker, text)


def test_strings_with_their_own_rules_keep_compiling_beside_the_marker_exclusion():
    """llguidance cannot meet every string rule with the markers' pattern (a minLength of 100
    already fails): such strings are left as they were, never turned into a 400."""
    from mlxkv.structured.compiler import check_grammar

    schema = {"type": "object", "properties": {
        "content": {"type": "string", "minLength": 4000}, "code": {"type": "string", "pattern": "^(ab|c)+$"},
        "when": {"type": "string", "format": "date-time"}, "name": {"type": "string", "maxLength": 500}}}
    for parser in ("json_tools", "qwen3_coder", "glm47", "kimi_k2"):
        check_grammar(tool_call_grammar("<tool_call>", "</tool_call>", [ToolSpec("t", {
            "type": "object", "properties": {"p": {"type": "object", "properties": schema["properties"]}}})],
            allow_text=False, parser=parser))
    check_grammar(tool_call_grammar("<tool_call>", "</tool_call>", [ToolSpec("t", schema)], allow_text=False))
