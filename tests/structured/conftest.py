"""What the tool-format tests share: one grammar compiler on the tiny model's tokenizer."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def compiler(llama_dir):
    from transformers import PreTrainedTokenizerFast

    from mlxkv.structured.compiler import GrammarCompiler

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=f"{llama_dir}/tokenizer.json")
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id or 0])
