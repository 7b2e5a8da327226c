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
  model here), against mlx-lm's speculative decoding on the same pair,
  as a user gets it and with every step verifying (the guard off);
- every row again on a float32 copy of a quantized model: this CPU's
  quantized matmul does not batch query tokens as a Mac's GPU does.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import statistics
import tempfile
import time

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import stream_generate
from mlx.utils import tree_flatten

from mlxkv.benchmarks.engine import _alternate, _fresh_copy, _mlx_lm_prefill, _stderr, _timed, describe_model
from mlxkv.benchmarks.rows import format_rows, row  # noqa: F401  (format_rows: the suite's printer)
from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.models import compat
from mlxkv.models.fetch import fetch_model
from mlxkv.models.loader import load_model
from mlxkv.speculative.step_cost import AlwaysSpeculate

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
    """The rows on the model as it is, then (`float_copy`) again on a float32 copy of it.

    The demo model is quantized; on a CPU, a quantized matmul of several
    query tokens costs about their number of single-token ones, where a
    Mac's GPU reads the weights once. The float copy shows what checking
    proposals costs when the matmul does batch, as on a Mac.
    """
    log = log or _stderr
    path = fetch_model(model, lambda text, fraction=None: None)
    rows = _rows(path, rounds, log)
    if float_copy and _is_quantized(load_model(path).model):
        with tempfile.TemporaryDirectory(prefix="mlxkv-float-copy-") as copy:
            _write_float_copy(path, copy)
            rows += _rows(copy, rounds, log, label=", float32 copy")
    return rows


def _rows(path: str, rounds: int, log, label: str = "") -> list[dict]:
    """Lookup (code edit, chat, a batch of 8) and the model drafting for itself."""
    loaded = load_model(path)
    plain = Engine(loaded, CacheConfig(memory_tier_bytes=0))
    lookup = Engine(loaded, CacheConfig(memory_tier_bytes=0, speculative="lookup"))
    rows = [_against_mlx_lm(f"code edit (lookup{label})", lookup, _edit(plain), EDIT_TOKENS, rounds, CODE_GOAL, log),
            _against_mlx_lm(f"free chat (lookup{label})", lookup, plain.apply_chat_template(CHAT), CHAT_TOKENS,
                            rounds, CHAT_GOAL, log),
            _batch_row(plain, lookup, rounds, log, label)]
    del plain, lookup
    draft = Engine(loaded, CacheConfig(memory_tier_bytes=0, speculative="draft", draft_model=path))
    rows.append(_against_mlx_lm(f"code edit (draft: itself{label})", draft, _edit(draft), EDIT_TOKENS, rounds, None,
                                log, draft_model=loaded.model))
    # The same with every step verifying: the draft path itself against mlx-lm's, where the row
    # above is what a user gets (the step-cost guard decodes plain where drafting does not pay).
    draft.loop.speculation.cost = AlwaysSpeculate()
    rows.append(_against_mlx_lm(f"code edit (draft: itself, every step{label})", draft, _edit(draft), EDIT_TOKENS,
                                rounds, None, log, draft_model=loaded.model))
    for r in rows:
        r["model"] = describe_model(draft)
    return rows


def _write_float_copy(src: str, dst: str) -> None:
    """The model at `src` with its weights dequantized to float32, as a model directory at `dst`
    (a draft model is loaded by path)."""
    loaded = load_model(src)
    model = compat.dequantize_model(loaded.model)
    model.set_dtype(mx.float32)
    mx.save_safetensors(os.path.join(dst, "model.safetensors"), dict(tree_flatten(model.parameters())))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    for name in os.listdir(src):  # the tokenizer's files
        if name.startswith("tokenizer") or name.endswith((".model", ".tiktoken")) or name == "chat_template.jinja":
            shutil.copy(os.path.join(src, name), dst)


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


def _batch_row(plain: Engine, lookup: Engine, rounds: int, log, label: str = "") -> dict:
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
    return row(f"batch of {len(prompts)} code edits (lookup{label})", "total tok/s", statistics.median(rates["lookup"]),
               statistics.median(rates["plain"]), "mlxkv without speculation", "report", True,
               f"aggregate tokens over wall time, decode after a cached prefill; greedy tokens "
               f"{'identical' if identical else 'DIFFER'}", ratio=ratio, tokens_identical=identical)


def _batch_rate(engine: Engine, prompts: list[list[int]], n: int):
    start = time.perf_counter()
    results = engine.generate_batch(prompts, max_tokens=n)
    wall = time.perf_counter() - start
    return [r.tokens for r in results], sum(len(r.tokens) for r in results) / wall
