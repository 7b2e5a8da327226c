"""`mlxkv bench structured` on the tiny model: its rows, and constrained rounds that really were."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_structured_benchmark_rows(llama_dir, monkeypatch):
    from mlxkv.benchmarks import structured

    monkeypatch.setattr(structured, "BATCH_TOKENS", 8)
    monkeypatch.setattr(structured, "STREAM_TOKENS", 8)
    rows = structured.run_structured_benchmark(llama_dir, rounds=1, log=lambda message: None)
    assert [r["name"] for r in rows] == ["batch of 8, tool-call grammar", "single stream, JSON schema",
                                         "compile a 20-tool schema, first", "compile a 20-tool schema, cached"]
    assert all(r["ours"] > 0 for r in rows[:3]) and rows[3]["ours"] < rows[2]["ours"]
    assert rows[3]["note"] == "1 cache hit"
    json.dumps(rows)  # --json prints them


def test_the_agent_tools_compile_into_one_grammar(llama_dir):
    from mlxkv.benchmarks.structured import _markers, agent_tools
    from mlxkv.models.compat import load_tokenizer
    from mlxkv.structured.compiler import check_grammar
    from mlxkv.structured.tool_grammar import tool_call_grammar

    grammar = tool_call_grammar(*_markers(load_tokenizer(llama_dir)), agent_tools(), allow_text=True)
    check_grammar(grammar)
    assert grammar.source.count('"const":"tool_') == 20
