"""Structured output in the engine (mlxkv/structured/): masks, the compile cache, the batch, speculation.

A random-weight model never writes valid JSON by chance, so a reply that
validates was made to. Greedy rows are compared token for token: a
constrained row batched with others equals its solo run, and with prompt
lookup equals without.
"""

from __future__ import annotations

import json

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.engine.records import RequestStats
from mlxkv.errors import MlxkvError
from mlxkv.speculative.proposer import Proposal
from mlxkv.speculative.step_cost import AlwaysSpeculate
from mlxkv.structured.grammar import Grammar
from mlxkv.structured.masks import apply_bitmask, cut_proposals, mask_decode
from mlxkv.structured.tool_grammar import ToolSpec, tool_call_grammar

CACHE = dict(block_size=8, num_blocks=512, memory_tier_bytes=0)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                           "days": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["city", "days"], "additionalProperties": False}
# Prompt lookup finds its proposals in the prompt: JSON there gives the constrained row some to check.
LOOKUP_PROMPT = 'Answer as {"city": "Oslo", "days": 3}; again {"city": "Oslo", "days": 3}: {"city": "'


@pytest.fixture(scope="module")
def engine(llama_dir):
    with Engine.load(llama_dir, CacheConfig(**CACHE)) as e:
        yield e


@pytest.fixture(scope="module")
def lookup_engine(llama_dir):
    with Engine.load(llama_dir, CacheConfig(**CACHE, speculative="lookup")) as e:
        e.loop.speculation.cost = AlwaysSpeculate()  # verify every step: this machine's clock decides nothing
        yield e


def test_apply_bitmask_equals_llguidance_numpy_reference():
    import llguidance.numpy as lln

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 70)).astype(np.float32)
    bitmask = rng.integers(-2**31, 2**31, size=(3, 3), dtype=np.int64).astype(np.int32)
    expected = logits.copy()
    lln.apply_token_bitmask_inplace(expected, bitmask)
    got = np.array(apply_bitmask(mx.array(logits), bitmask))
    assert np.array_equal(np.isinf(got), np.isinf(expected)) and np.isinf(got).any()
    assert np.array_equal(got[~np.isinf(got)], expected[~np.isinf(expected)])


def test_a_json_schema_reply_validates_and_ends_on_eos(engine):
    free = engine.generate("Tell me about Oslo", max_tokens=30)
    with pytest.raises(json.JSONDecodeError):
        json.loads(free.text)  # the model alone writes no JSON: the grammar below does the work
    result = engine.generate("Tell me about Oslo", grammar=Grammar.json_schema(SCHEMA), max_tokens=60)
    jsonschema.validate(json.loads(result.text), SCHEMA)
    assert result.finish_reason == "stop"


def test_sampled_rows_and_a_regex_are_masked_too(engine):
    for options in ({}, {"temperature": 1.0, "seed": 7}):
        result = engine.generate("code:", grammar=Grammar.regex("[A-Z]{3}-[0-9]{2}"), max_tokens=20, **options)
        assert len(result.text) == 6 and result.text[:3].isupper() and result.text[4:].isdigit(), result.text


def test_the_compile_cache_hits_on_the_same_grammar(engine):
    schema = {"type": "object", "properties": {"q": {"type": "boolean"}}, "required": ["q"]}
    before = dict(engine.stats()["structured"])
    for _ in range(3):
        engine.generate("x", grammar=Grammar.json_schema(schema), max_tokens=12)
    after = engine.stats()["structured"]
    assert after["compile_cache_misses"] == before["compile_cache_misses"] + 1
    assert after["compile_cache_hits"] == before["compile_cache_hits"] + 2
    assert after["mask_steps"] > before["mask_steps"] and after["compile_s"] > 0


def test_an_uncompilable_grammar_is_an_mlxkv_error_naming_it(engine):
    with pytest.raises(MlxkvError, match="frob"):
        engine.generate("x", grammar=Grammar.json_schema({"type": "frob"}), max_tokens=4)
    with pytest.raises(MlxkvError, match="nothing_here"):
        engine.generate("x", grammar=Grammar.lark("start: nothing_here"), max_tokens=4)


@pytest.mark.slow  # over ~0.7 s under load: the not-slow budget is nearly spent
def test_a_batch_of_mixed_rows_gives_each_its_solo_tokens(engine):
    prompts = [f"Question {i}: where and how long?" for i in range(8)]
    grammars = [Grammar.json_schema(SCHEMA) if i % 2 == 0 else None for i in range(8)]
    solo = [engine.generate(p, grammar=g, max_tokens=40).tokens for p, g in zip(prompts, grammars)]
    records: list[list] = [[] for _ in prompts]
    for i, (p, g) in enumerate(zip(prompts, grammars)):
        engine.loop.add(engine.make_request(p, records[i].append, grammar=g, max_tokens=40))
    while engine.loop.has_work:
        engine.loop.step()
    batched = [[r.token for r in recs] for recs in records]
    assert batched == solo
    for tokens, g in zip(batched[::2], grammars[::2]):
        jsonschema.validate(json.loads(engine.tokenizer.decode(tokens[:-1])), SCHEMA)  # the last is EOS


def test_lookup_speculation_gives_the_same_tokens_and_cuts_proposals(engine, lookup_engine):
    grammar = Grammar.json_schema(SCHEMA)
    plain = engine.generate(LOOKUP_PROMPT, grammar=grammar, max_tokens=40)
    fast = lookup_engine.generate(LOOKUP_PROMPT, grammar=grammar, max_tokens=40)
    assert fast.tokens == plain.tokens
    assert lookup_engine.stats()["speculative"]["proposed"] > 0  # proposals were checked, not absent


def test_a_mixed_batch_under_lookup_equals_plain_and_sampled_rows_stay_valid(engine, lookup_engine):
    prompts = [LOOKUP_PROMPT + str(i) for i in range(4)]
    grammars = [Grammar.json_schema(SCHEMA), None, Grammar.json_schema(SCHEMA), None]

    def batch(e, **options):
        records: list[list] = [[] for _ in prompts]
        for i, (p, g) in enumerate(zip(prompts, grammars)):
            e.loop.add(e.make_request(p, records[i].append, grammar=g, max_tokens=30, **options))
        while e.loop.has_work:
            e.loop.step()
        return [[r.token for r in recs] for recs in records]

    assert batch(lookup_engine) == batch(engine)
    sampled = batch(lookup_engine, temperature=1.0, seed=5)
    for tokens in sampled[::2]:
        jsonschema.validate(json.loads(lookup_engine.tokenizer.decode(tokens[:-1])), SCHEMA)


def test_a_draft_model_drafts_within_the_grammar_and_the_tokens_stay_the_same(llama_dir, engine):
    config = CacheConfig(**CACHE, speculative="draft", draft_model=llama_dir)
    with Engine.load(llama_dir, config) as drafted:
        drafted.loop.speculation.cost = AlwaysSpeculate()
        grammar = Grammar.json_schema(SCHEMA)
        fast = drafted.generate(LOOKUP_PROMPT, grammar=grammar, max_tokens=40)
        assert drafted.stats()["speculative"]["proposed"] > 0  # unmasked, its first token was always refused
    assert fast.tokens == engine.generate(LOOKUP_PROMPT, grammar=grammar, max_tokens=40).tokens


def test_cut_proposals_stops_at_the_first_refused_token(engine):
    tokenizer = engine.tokenizer
    request = engine.make_request("x", lambda r: None, grammar=Grammar.json_schema(SCHEMA))
    good = tokenizer.encode('{"city": "Os"', add_special_tokens=False)
    bad = tokenizer.encode('}, "days": 2}', add_special_tokens=False)  # "days" is required before the "}"
    [cut] = cut_proposals({request: Proposal(good + bad)}).values()
    assert cut.tokens == good
    assert request.grammar.consumed == 0 and request.grammar.valid_prefix(good) == len(good)  # state unchanged


def test_a_tool_call_grammar_writes_what_mlx_lm_s_parser_reads(engine):
    tokenizer = engine.tokenizer
    tools = [ToolSpec("get_weather", SCHEMA), ToolSpec("noop", None)]
    grammar = tool_call_grammar(tokenizer.tool_call_start, tokenizer.tool_call_end, tools, allow_text=False)
    result = engine.generate("weather?", grammar=grammar, max_tokens=80)
    assert result.finish_reason == "stop", result.text
    body = result.text.removeprefix(tokenizer.tool_call_start).removesuffix(tokenizer.tool_call_end)
    call = tokenizer.tool_parser(body, None)
    assert call["name"] in ("get_weather", "noop")
    if call["name"] == "get_weather":
        jsonschema.validate(call["arguments"], SCHEMA)


def test_generate_command_takes_a_json_schema_file_and_a_regex(llama_dir, tmp_path, capsys):
    from mlxkv.cli import main

    schema_file = tmp_path / "trip.json"
    schema_file.write_text(json.dumps(SCHEMA))
    assert main(["generate", "--model", llama_dir, "--json", "--max-tokens", "60", "--prompt", "Oslo?",
                 "--json-schema", str(schema_file), "--num-blocks", "256"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    jsonschema.validate(json.loads(row["text"]), SCHEMA)
    assert main(["generate", "--model", llama_dir, "--max-tokens", "10", "--prompt", "x", "--regex", "[0-9]{4}",
                 "--num-blocks", "256"]) == 0
    assert capsys.readouterr().out.strip().isdigit()
    assert main(["generate", "--model", llama_dir, "--prompt", "x", "--json-schema", str(tmp_path / "none"),
                 "--num-blocks", "256"]) == 2


def test_a_matcher_rolls_back_and_a_complete_grammar_allows_only_eos(engine):
    request = engine.make_request("x", lambda r: None, grammar=Grammar.regex("ab"))
    matcher, tokenizer = request.grammar, engine.tokenizer
    [a], [b] = tokenizer.encode("a", add_special_tokens=False), tokenizer.encode("b", add_special_tokens=False)
    matcher.advance([a, b])
    assert matcher.accepting and matcher.consumed == 2
    matcher.rollback(1)
    assert not matcher.accepting and matcher.consumed == 1 and matcher.valid_prefix([b]) == 1
    matcher.advance([b])
    request.stats = RequestStats.unknown(1)  # as admission gives it: the masks write their time there
    request._waiting_output = [a, b]  # a preempted request's kept tokens: its output while it holds no sequence
    request.issue(2)
    logits = mask_decode([request], None, mx.zeros((1, engine.loaded.vocab_size)))
    allowed = set(np.flatnonzero(np.isfinite(np.array(logits[0]))).tolist())
    assert allowed == set(engine.tokenizer.eos_token_ids)


def test_auto_allows_text_or_one_valid_call_and_nothing_else(engine):
    tokenizer = engine.tokenizer
    grammar = tool_call_grammar(tokenizer.tool_call_start, tokenizer.tool_call_end,
                                [ToolSpec("get_weather", SCHEMA)], allow_text=True)
    matcher = engine.structured.matcher(grammar)

    def whole(text: str) -> bool:
        ids = tokenizer.encode(text, add_special_tokens=False)
        return matcher.valid_prefix(ids) == len(ids)

    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}</tool_call>'
    assert whole("Just text, with a <tool in it.") and whole(call) and whole("Let me check. " + call)
    assert not whole('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}')  # days is required
    assert not whole('<tool_call>{"name": "other", "arguments": {}}')


def test_markers_that_are_added_tokens_are_written_as_their_tokens(llama_dir):
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    from mlxkv.models.compat import added_token_id
    from mlxkv.structured.compiler import GrammarCompiler

    base = Tokenizer.from_file(f"{llama_dir}/tokenizer.json")
    base.add_tokens([AddedToken(m, special=False, normalized=False) for m in ("<tool_call>", "</tool_call>")])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=base)  # Qwen's kind: the markers are added tokens
    ids = (added_token_id(tokenizer, "<tool_call>"), added_token_id(tokenizer, "</tool_call>"))
    assert None not in ids and added_token_id(tokenizer, "hello") is None
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [0, 2])
    call = tokenizer.encode('<tool_call>{"name": "noop", "arguments": {}}</tool_call>', add_special_tokens=False)
    assert call[0] == ids[0] and call[-1] == ids[1]  # the model writes each marker as one token
    for allow_text in (False, True):
        grammar = tool_call_grammar("<tool_call>", "</tool_call>", [ToolSpec("noop", None)], allow_text, ids)
        matcher = compiler.matcher(grammar)
        assert matcher.valid_prefix(call) == len(call)
        text = tokenizer.encode("Let me see. ", add_special_tokens=False)
        assert matcher.valid_prefix(text + call) == (len(text + call) if allow_text else 0)


def test_the_llguidance_tokenizer_is_built_on_the_compiler_s_worker_not_the_engine_thread(llama_dir, monkeypatch):
    import threading

    import llguidance.hf
    from transformers import PreTrainedTokenizerFast

    from mlxkv.structured.compiler import GrammarCompiler

    built_on, build = [], llguidance.hf.from_tokenizer

    def recording(*args, **kwargs):
        built_on.append(threading.current_thread().name)
        return build(*args, **kwargs)

    monkeypatch.setattr(llguidance.hf, "from_tokenizer", recording)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=f"{llama_dir}/tokenizer.json")
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [0])
    engine_thread = threading.Thread(target=lambda: compiler.matcher(Grammar.regex("ab")), name="mlxkv-engine")
    engine_thread.start()
    engine_thread.join()
    assert len(built_on) == 1 and built_on[0].startswith("mlxkv-masks"), built_on
    assert compiler.stats.misses == 1  # the engine thread's grammar compiled, with that tokenizer
