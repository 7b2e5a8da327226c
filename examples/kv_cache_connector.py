"""KV cache connector, end to end: evicted blocks spill to a tier and come back.

The pool is sized too small to hold two conversations at once. Conversation
A's first turn fills it, conversation B pushes A's blocks out (they spill to
the memory tier, and to SSD with --disk-tier), and A's second turn, which
starts with its first turn, hydrates them back instead of recomputing.

    python examples/kv_cache_connector.py [--model demo] [--disk-tier DIR]
"""

from __future__ import annotations

import argparse
import json

import mlxkv  # noqa: F401  (first: loads the real BLAS before mlx)
from mlxkv import CacheConfig, Engine, MlxkvError
from mlxkv.chat.prompting import chat_prompt
from mlxkv.models.loader import load_tokenizer

BLOCK = 16


def turn(engine: Engine, label: str, messages: list[dict]):
    result = engine.chat(messages, max_tokens=24)
    s = result.stats
    print(f"{label}: {s.prompt_tokens} prompt tokens, reused {s.cached_tokens}, computed {s.computed_tokens}")
    for tier, counters in engine.stats()["connector"].items():
        keys = ("stores", "lookups", "hit_blocks", "spills", "hydrations", "blocks_held")
        print(f"    {tier:6s} " + " ".join(f"{k}={counters[k]}" for k in keys))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--disk-tier", default=None, help="also spill to an SSD tier in DIR")
    args = parser.parse_args()

    system = {"role": "system", "content": "You are a patient assistant. " * 12}
    a = [system, {"role": "user", "content": "Tell me a story about the sea. " * 3}]
    # Longer than all of A, so its prompt alone pushes A out of the pool, whatever the replies.
    b = [{"role": "user", "content": "Now something else entirely: mountains and snow. " * 16}]

    tokenizer = load_tokenizer(args.model)  # prompts need no model and no pool
    longest = max(len(chat_prompt(tokenizer, m)) for m in (a, b)) + 2 * 24 + 40
    # Room for the longest conversation, not for two of them.
    blocks = -(-longest // BLOCK) + 1
    config = CacheConfig(block_size=BLOCK, num_blocks=blocks, disk_tier=args.disk_tier)
    with Engine.load(args.model, config) as engine:
        print(f"pool: {blocks} blocks of {BLOCK} tokens")
        reply = turn(engine, "A, turn 1", a)
        turn(engine, "B, turn 1", b)
        # The reply goes back with its ids, so turn 2 finds all of turn 1 cached.
        a += [reply.as_message(), {"role": "user", "content": "And then?"}]
        turn(engine, "A, turn 2", a)
        print(json.dumps(engine.stats()["pool"]))


if __name__ == "__main__":
    try:
        main()
    except MlxkvError as e:  # a bad --model or --disk-tier: one line, as the CLI says it
        raise SystemExit(f"kv_cache_connector.py: error: {e}") from None
