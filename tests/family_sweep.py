"""The family sweep's worker: every mlx-lm model module, a tiny model of it, mlxkv against mlx-lm.

Run as `python tests/family_sweep.py [--oracle-only] MODULE...`: one JSON line
per module on stdout (and a `{"start": module}` line before each, so that a
process the module crashes names it). For each family:

- mlx-lm's greedy tokens and log-probabilities on prompt A, cold, with its
  prefill in one chunk and in chunks of CHUNK tokens: the difference
  between the two is mlx-lm's own chunking spread, the scale of what
  computing a prefix apart (a hit) may change;
- mlxkv on A, then on B = A + its reply + more (a chat's next turn, a prefix
  hit), then on three fresh prompts in one batch; each against mlx-lm.

A module that is no family (a shared helper) says so; one mlx-lm itself
cannot run here says why, with mlx-lm's own error.
"""

from __future__ import annotations

import json
import sys

import mlxkv  # noqa: F401  (before mlx: it loads the BLAS)
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.engine.records import RequestFailed
from mlxkv.models import compat
from mlxkv.models.loader import LoadedModel
from mlxkv.models.tiny_args import tiny_family_model

BLOCK = 16
TOKENS = 8
CHUNK = 16  # mlx-lm's prefill chunk for its spread
SEED = 7
PROMPT_A = [(7 * i + 5) % 500 + 3 for i in range(45)]  # 45 + 8 - 1 tokens computed: 3 full blocks
MORE = [(5 * i + 1) % 500 + 3 for i in range(7)]
# Rows of different lengths, and one of a single token (its state, if any, starts in the batch).
BATCH = [[(3 * i + 2) % 500 + 3 for i in range(23)], [(11 * i + 4) % 500 + 3 for i in range(37)], [5]]
# plamo3 asks its sliding mask for window + 1 tokens, but its RotatingKVCache holds
# window: mlx-lm's prefill sees window + 1, its decode window. mlxkv serves the mask
# the model asks for at every step, so its oracle is mlx-lm with caches that hold it.
MASK_WINDOW_ORACLE = {"plamo3"}


class _Detokenizer:
    last_segment = ""

    def add_token(self, token):
        pass

    def finalize(self):
        pass


class _Tokenizer:
    """Token ids in, token ids out: the sweep never needs text, and no token ends a reply."""

    eos_token_ids = frozenset()

    @property
    def detokenizer(self):
        return _Detokenizer()


def oracle(model, prompt: list[int], family: str, step: int = 2048) -> tuple[list[int], list[mx.array]]:
    """mlx-lm's greedy tokens and the log-probabilities each was taken from."""
    cache = make_prompt_cache(model)
    if family in MASK_WINDOW_ORACLE:
        cache = [RotatingKVCache(c.max_size + 1) if isinstance(c, RotatingKVCache) else c for c in cache]
    steps = list(generate_step(mx.array(prompt), model, max_tokens=TOKENS, prefill_step_size=step,
                               prompt_cache=cache))
    return [t for t, _ in steps], [lp for _, lp in steps]


def ours(engine: Engine, prompts: list[list[int]]) -> list[tuple[list[int], list[mx.array], dict]]:
    """mlxkv's greedy tokens, log-probabilities and cached tokens for prompts run as one batch."""
    runs = [{"tokens": [], "logprobs": [], "cached": {}, "failed": None} for _ in prompts]

    def sink(run):
        def take(record):
            if isinstance(record, RequestFailed):
                run["failed"] = record.message
                return
            run["tokens"].append(record.token)
            if record.stats is not None:
                run["cached"] = record.stats.cached_tokens
        return take

    def recording(greedy, seen):
        def sample(logprobs):
            seen.append(logprobs)
            return greedy(logprobs)
        return sample

    for prompt, run in zip(prompts, runs):
        request = engine.make_request(prompt, sink(run), max_tokens=TOKENS)
        request.sampler = recording(request.sampler, run["logprobs"])
        engine.loop.add(request)
    while engine.loop.has_work:
        engine.loop.step()
    for run in runs:
        if run["failed"]:
            raise RuntimeError(run["failed"])
    return [(r["tokens"], r["logprobs"][: len(r["tokens"])], r["cached"]) for r in runs]


def spread(a: list[mx.array], b: list[mx.array], tokens_a: list[int], tokens_b: list[int]) -> float:
    """Largest log-probability difference over the steps both took alike."""
    worst = 0.0
    for la, lb, ta, tb in zip(a, b, tokens_a, tokens_b):
        # Masked ids are -inf on both sides: compare them as a finite floor, so they never make a NaN.
        la, lb = (mx.maximum(x.reshape(-1).astype(mx.float32), -1e9) for x in (la, lb))
        worst = max(worst, mx.max(mx.abs(la - lb)).item())
        if ta != tb:
            break
    return worst


def sweep(family: str) -> dict:
    try:
        compat.family_classes(family)
    except AttributeError:
        return {"family": family, "status": "helper", "reason": "a shared module, not a model family"}
    except SystemExit as e:  # olmo's module exits without its extra package
        return {"family": family, "status": "skip",
                "reason": f"mlx-lm cannot import it here: its module exits ({e.code}), wanting a package"}
    except Exception as e:
        return {"family": family, "status": "skip", "reason": f"mlx-lm cannot import it here: {_line(e)}"}
    model, config = tiny_family_model(family, SEED)
    try:
        ref_a, lp_a = oracle(model, PROMPT_A, family)
        chunked = oracle(model, PROMPT_A, family, CHUNK)
    except Exception as e:
        return {"family": family, "status": "skip", "reason": f"mlx-lm cannot run it here: {_line(e)}"}
    prompt_b = PROMPT_A + ref_a + MORE
    ref_b, lp_b = oracle(model, prompt_b, family)
    refs = [oracle(model, p, family) for p in BATCH]
    result = {"family": family, "status": "ok", "spread": spread(lp_a, chunked[1], ref_a, chunked[0]),
              "reference": [ref_a, ref_b] + [r[0] for r in refs]}
    engine = Engine(LoadedModel(model, _Tokenizer(), config, family),
                    CacheConfig(block_size=BLOCK, num_blocks=256, memory_tier_bytes=0))
    layout = engine.coordinator.group_layout
    result["layout"] = layout.describe()
    result["batched"] = layout.batched
    (a, la, _), = ours(engine, [PROMPT_A])
    (b, lb, cached), = ours(engine, [prompt_b])
    batch = ours(engine, BATCH)
    result["ours"] = [a, b] + [t for t, _, _ in batch]
    result["logprob_diff"] = max(spread(la, lp_a, a, ref_a), spread(lb, lp_b, b, ref_b))
    result["hit"] = cached.get("pool", 0)
    result["expected_hit"] = (len(PROMPT_A) + TOKENS - 1) // BLOCK * BLOCK
    return result


def _line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".strip()


def main(argv: list[str]) -> None:
    oracle_only = argv[:1] == ["--oracle-only"]
    for family in argv[1:] if oracle_only else argv:
        print(json.dumps({"start": family}), flush=True)
        if oracle_only:
            model, _ = tiny_family_model(family, SEED)
            oracle(model, PROMPT_A, family)
            oracle(model, PROMPT_A, family, CHUNK)
            print(json.dumps({"family": family, "status": "oracle"}), flush=True)
            continue
        try:
            result = sweep(family)
        except Exception as e:  # a failure of mlxkv's, named for the test
            result = {"family": family, "status": "error", "reason": _line(e)}
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
