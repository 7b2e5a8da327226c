"""`mlxkv bench structured`: what enforcing a grammar costs decode, and compiling one, on the demo model.

Greedy, alternated rounds, each side's decode tok/s side by side:
- a batch of 8 replies held to a tool call (the model's own call markers,
  a write_file tool whose content runs to max_tokens), against the same
  batch unconstrained (goal >= 0.9x);
- a single reply held to a JSON schema, against the same reply free
  (goal >= 0.95x);
- compiling an agent's 20 tools into one tool-call grammar: first, and
  again from the compile cache (reported).
"""

from __future__ import annotations

import statistics
import time

from mlxkv.benchmarks.engine import _alternate, _stderr, _timed, describe_model
from mlxkv.benchmarks.rows import format_rows, row  # noqa: F401  (format_rows: the suite's printer)
from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.models.fetch import fetch_model
from mlxkv.structured.compiler import GrammarCompiler
from mlxkv.structured.grammar import Grammar
from mlxkv.structured.tool_grammar import ToolSpec, tool_call_grammar

ROUNDS = 3
BATCH_TOKENS = 96
STREAM_TOKENS = 128
BATCH_GOAL, STREAM_GOAL = 0.9, 0.95
WRITE_FILE = ToolSpec("write_file", {"type": "object", "properties": {
    "path": {"type": "string", "maxLength": 40}, "content": {"type": "string", "minLength": 4000}},
    "required": ["path", "content"], "additionalProperties": False})
STORY = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 60},
                                          "story": {"type": "string", "minLength": 4000}},
         "required": ["title", "story"], "additionalProperties": False}


def agent_tools(n: int = 20) -> list[ToolSpec]:
    """An agent's kind of tool set: each with a few typed arguments, an enum, a nested object."""
    return [ToolSpec(f"tool_{i}", {"type": "object", "properties": {
        "path": {"type": "string"}, "line": {"type": "integer", "minimum": 1},
        "mode": {"enum": ["read", "write", "append"]}, "recursive": {"type": "boolean"},
        "options": {"type": "object", "properties": {"depth": {"type": "integer"}, "glob": {"type": "string"}},
                    "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8}},
        "required": ["path", "mode"], "additionalProperties": False}) for i in range(n)]


def run_structured_benchmark(model: str = "demo", rounds: int = ROUNDS, log=None) -> list[dict]:
    log = log or _stderr
    engine = Engine.load(fetch_model(model, lambda text, fraction=None: None), CacheConfig(memory_tier_bytes=0))
    with engine:
        rows = [_batch_row(engine, rounds, log), _stream_row(engine, rounds, log), *_compile_rows(engine)]
        for r in rows:
            r["model"] = describe_model(engine)
    return rows


def _batch_row(engine: Engine, rounds: int, log) -> dict:
    grammar = tool_call_grammar(*_markers(engine.tokenizer), [WRITE_FILE], allow_text=False)
    files = ["notes.md", "main.py", "todo.txt", "app.js", "README.md", "setup.cfg", "index.html", "log.txt"]
    prompts = [engine.apply_chat_template([{"role": "user", "content": f"Write a long {f} with write_file."}])
               for f in files]
    engine.generate_batch(prompts, max_tokens=1)  # untimed: the prompts' prefill, cached for both sides

    def side(options):
        def run():
            start = time.perf_counter()
            results = engine.generate_batch(prompts, max_tokens=BATCH_TOKENS, **options)
            return [r.tokens for r in results], sum(len(r.tokens) for r in results) / (time.perf_counter() - start)
        return run

    log(f"batch of {len(prompts)} tool calls: {rounds} rounds per side ...")
    side({"grammar": grammar})()  # warm: the compile, then cache hits
    outputs, rates = _alternate({"constrained": side({"grammar": grammar}), "free": side({})}, rounds, log)
    ratio = statistics.median(c / f for c, f in zip(rates["constrained"], rates["free"]))
    tokens = sum(map(len, outputs["constrained"][0]))
    return row(f"batch of {len(prompts)}, tool-call grammar", "total tok/s", statistics.median(rates["constrained"]),
               statistics.median(rates["free"]), "the same batch unconstrained", f">= {BATCH_GOAL:.2f}",
               ratio >= BATCH_GOAL, f"{tokens} tokens per constrained round, aggregate over wall time after a "
               f"cached prefill; {rounds} alternated rounds", ratio=ratio)


def _markers(tokenizer) -> tuple[str, str]:
    """The model's tool-call markers; the JSON-body ones for a model without (the demo model):
    the masks cost the same, the markers are then text."""
    if getattr(tokenizer, "has_tool_calling", False):
        return tokenizer.tool_call_start, tokenizer.tool_call_end
    return "<tool_call>", "</tool_call>"


def _stream_row(engine: Engine, rounds: int, log) -> dict:
    prompt = engine.apply_chat_template([{"role": "user", "content": "Tell me a long story about the sea, as JSON."}])
    grammar = Grammar.json_schema(STORY)
    engine.generate(prompt, max_tokens=1)

    def side(options):
        return lambda: _timed(c.token for c in engine.stream(prompt, max_tokens=STREAM_TOKENS, **options))

    log(f"a single JSON-schema stream: {rounds} rounds per side ...")
    outputs, rates = _alternate({"constrained": side({"grammar": grammar}), "free": side({})}, rounds, log)
    ratio = statistics.median(c / f for c, f in zip(rates["constrained"], rates["free"]))
    return row("single stream, JSON schema", "decode tok/s", statistics.median(rates["constrained"]),
               statistics.median(rates["free"]), "the same stream unconstrained", f">= {STREAM_GOAL:.2f}",
               ratio >= STREAM_GOAL, f"{len(outputs['constrained'][0])} tokens; {rounds} alternated rounds",
               ratio=ratio)


def _compile_rows(engine: Engine) -> list[dict]:
    """A 20-tool grammar on a fresh compiler (its tokenizer built first, untimed): first, then cached."""
    tokenizer = engine.tokenizer
    compiler = GrammarCompiler(tokenizer, engine.loaded.vocab_size, tokenizer.eos_token_ids)
    start = time.perf_counter()
    compiler.ll_tokenizer
    tokenizer_s = time.perf_counter() - start
    grammar = tool_call_grammar(*_markers(tokenizer), agent_tools(), allow_text=True)
    times = []
    for _ in range(2):
        start = time.perf_counter()
        compiler.matcher(grammar)
        times.append((time.perf_counter() - start) * 1e3)
    first, cached = times
    note = f"llguidance's tokenizer built once per model in {tokenizer_s * 1e3:.0f} ms (not counted)"
    return [row("compile a 20-tool schema, first", "ms", first, None, "-", "report", True, note),
            row("compile a 20-tool schema, cached", "ms", cached, first, "the first compile", "report", True,
                f"{compiler.stats.hits} cache hit")]
