"""`mlxkv bench speculative`: decode speed with speculation against mlx-lm, on the demo model.

Greedy, the same prompt token ids, the same number of tokens, alternated
rounds: mlxkv with `--speculative lookup` (or `draft`) against mlx-lm's
`stream_generate` (or its draft-model `stream_generate`), each decoding
from a prefilled prompt; the ratio is the median of per-round ratios of
decode tok/s, and the tokens must be identical.

- code edit: the prompt holds a 150-line source file and asks for it back
  with one change: the reply copies most of its prompt (an agent's case);
- free chat: a story, nothing to copy;
- a batch of 8 code edits, against the same batch without speculation;
- a draft model: the demo model drafting for itself (the one trained
  model here), against mlx-lm's speculative decoding on the same pair;
- the code edit and chat again on a float32 copy of a quantized model:
  this CPU's quantized matmul does not batch query tokens as a Mac's GPU does.
"""

from __future__ import annotations

import inspect
import statistics
import time

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import stream_generate
from mlx_lm.utils import dequantize_model

from mlxkv.benchmarks.engine import _alternate, _fresh_copy, _mlx_lm_prefill, _stderr, _timed, describe_model
from mlxkv.benchmarks.rows import format_rows, row  # noqa: F401  (format_rows: the suite's printer)
from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.models.fetch import fetch_model
from mlxkv.models.loader import load_model

ROUNDS = 3
EDIT_LINES = 150
EDIT_TOKENS = 400
CHAT_TOKENS = 200
CODE_GOAL, CHAT_GOAL = 2.0, 1.0


def code_edit_messages(rename: str = "BatchScheduler") -> list[dict]:
    from mlxkv.engine import scheduler

    source = "\n".join(inspect.getsource(scheduler).splitlines()[:EDIT_LINES])
    ask = (f"Here is a Python file:\n\n```python\n{source}\n```\n\nRewrite the whole file, unchanged except that "
           f"the class Scheduler is renamed to {rename}. Output only the code.")
    return [{"role": "user", "content": ask}]


CHAT = [{"role": "user", "content": "Tell me a story about the sea and the ships that sail upon it."}]


def run_speculative_benchmark(model: str = "demo", rounds: int = ROUNDS, log=None, float_copy: bool = True) -> list[dict]:
    """The rows on the model as it is, then (`float_copy`) the lookup rows again on a float32 copy of it.

    The demo model is quantized; on a CPU, a quantized matmul of several
    query tokens costs about their number of single-token ones, where a
    Mac's GPU reads the weights once. The float copy shows what checking
    proposals costs when the matmul does batch, as on a Mac.
    """
    log = log or _stderr
    path = fetch_model(model, lambda text, fraction=None: None)
    loaded = load_model(path)
    rows = _lookup_rows(loaded, rounds, log, batch=True)
    draft = Engine(loaded, CacheConfig(memory_tier_bytes=0, speculative="draft", draft_model=model))
    rows.append(_against_mlx_lm("code edit (draft: itself)", draft, _edit(draft), EDIT_TOKENS, rounds, None, log,
                                draft_model=loaded.model))
    for r in rows:
        r["model"] = describe_model(draft)
    if float_copy and _is_quantized(loaded.model):
        copy = load_model(path)
        copy.model = dequantize_model(copy.model)
        copy.model.set_dtype(mx.float32)
        extra = _lookup_rows(copy, rounds, log, batch=False, label=", float32 copy")
        for r in extra:
            r["model"] = describe_model(Engine(copy, CacheConfig(memory_tier_bytes=0)))
        rows += extra
    return rows


def _lookup_rows(loaded, rounds: int, log, batch: bool, label: str = "") -> list[dict]:
    plain = Engine(loaded, CacheConfig(memory_tier_bytes=0))
    lookup = Engine(loaded, CacheConfig(memory_tier_bytes=0, speculative="lookup"))
    rows = [_against_mlx_lm(f"code edit (lookup{label})", lookup, _edit(plain), EDIT_TOKENS, rounds, CODE_GOAL, log),
            _against_mlx_lm(f"free chat (lookup{label})", lookup, plain.apply_chat_template(CHAT), CHAT_TOKENS,
                            rounds, CHAT_GOAL, log)]
    return rows + ([_batch_row(plain, lookup, rounds, log)] if batch else [])


def _edit(engine: Engine) -> list[int]:
    return engine.apply_chat_template(code_edit_messages())


def _is_quantized(model) -> bool:
    return any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())


def _against_mlx_lm(name: str, engine: Engine, prompt: list[int], n: int, rounds: int, goal, log,
                    draft_model=None) -> dict:
    model, tokenizer = engine.model, engine.tokenizer
    prefilled = _mlx_lm_prefill(model, prompt)
    draft_prefilled = _mlx_lm_prefill(draft_model, prompt) if draft_model is not None else []
    extra = {"draft_model": draft_model, "num_draft_tokens": 4} if draft_model is not None else {}

    def ours():
        return _timed(c.token for c in engine.stream(prompt, max_tokens=n))

    def theirs():
        caches = _fresh_copy(prefilled) + _fresh_copy(draft_prefilled)
        return _timed(r.token for r in stream_generate(model, tokenizer, prompt[-1:], max_tokens=n,
                                                       prompt_cache=caches, **extra))

    log(f"{name}: {rounds} rounds per side, {n} tokens ...")
    reference, warm_up = theirs()[0], ours()[0]
    before = dict(engine.stats()["speculative"])
    outputs, rates = _alternate({"mlxkv": ours, "mlx-lm": theirs}, rounds, log)
    after = engine.stats()["speculative"]
    identical = all(t == reference for t in [warm_up, *outputs["mlxkv"], *outputs["mlx-lm"]])
    ratio = statistics.median(o / t for o, t in zip(rates["mlxkv"], rates["mlx-lm"]))
    proposed, accepted = after["proposed"] - before["proposed"], after["accepted"] - before["accepted"]
    per_step = (after["emitted"] - before["emitted"]) / max(after["rows"] - before["rows"], 1)
    against = "mlx-lm draft-model stream_generate" if draft_model is not None else "mlx-lm stream_generate"
    return row(
        name, "decode tok/s", statistics.median(rates["mlxkv"]), statistics.median(rates["mlx-lm"]), against,
        "report" if goal is None else f">= {goal:.2f}", True if goal is None else ratio >= goal,
        f"{len(prompt)}-token prompt, {len(reference)} tokens, {rounds} alternated rounds; accepted "
        f"{accepted}/{proposed} proposed, {per_step:.2f} tokens per proposing step; greedy tokens "
        f"{'identical' if identical else 'DIFFER'}",
        ratio=ratio, tokens_identical=identical, acceptance=accepted / proposed if proposed else 0.0,
    )


def _batch_row(plain: Engine, lookup: Engine, rounds: int, log) -> dict:
    """Eight code edits as one batch: aggregate tok/s with speculation against without."""
    names = ["BatchScheduler", "StepScheduler", "Planner", "Admitter", "Dispatcher", "Queue", "Runner", "Pacer"]
    prompts = [plain.apply_chat_template(code_edit_messages(rename=n)) for n in names]
    for engine in (plain, lookup):  # untimed: the prompts' prefill
        engine.generate_batch(prompts, max_tokens=1)

    def side(engine):
        return lambda: _batch_rate(engine, prompts, EDIT_TOKENS // 2)

    log(f"batch of {len(prompts)} code edits: {rounds} rounds per side ...")
    outputs, rates = _alternate({"lookup": side(lookup), "plain": side(plain)}, rounds, log)
    identical = all(o == outputs["plain"][0] for o in outputs["lookup"] + outputs["plain"])
    ratio = statistics.median(o / t for o, t in zip(rates["lookup"], rates["plain"]))
    return row(f"batch of {len(prompts)} code edits (lookup)", "total tok/s", statistics.median(rates["lookup"]),
               statistics.median(rates["plain"]), "mlxkv without speculation", "report", True,
               f"aggregate tokens over wall time, decode after a cached prefill; greedy tokens "
               f"{'identical' if identical else 'DIFFER'}", ratio=ratio, tokens_identical=identical)


def _batch_rate(engine: Engine, prompts: list[list[int]], n: int):
    start = time.perf_counter()
    results = engine.generate_batch(prompts, max_tokens=n)
    wall = time.perf_counter() - start
    return [r.tokens for r in results], sum(len(r.tokens) for r in results) / wall
