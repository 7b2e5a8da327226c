"""`mlxkv bench blas`: MLX on a real BLAS against the bundled reference one.

A BLAS cannot be unloaded once MLX has bound to it, so each side runs in
its own child interpreter (`MLXKV_BLAS=off` for the reference side) and
reports rates as one JSON line; the parent pairs them into rows with a
real/reference ratio. Both sides run in the same invocation, so the ratio
compares like with like on one machine.

The reference BLAS is ~30x slower, so each timed loop stops after a time
budget rather than a fixed count: the slow side does fewer iterations of
the same work, and rates stay per-iteration fair.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

MATMUL_SIZES = (1024, 2048)
PROMPT_TOKENS = 128
DECODE_TOKENS = 8
BUDGET_S = 1.0  # per timed loop; at least one iteration always runs



def run_blas_benchmark(
    matmul_sizes=MATMUL_SIZES,
    prompt_tokens: int = PROMPT_TOKENS,
    decode_tokens: int = DECODE_TOKENS,
    budget_s: float = BUDGET_S,
) -> list[dict]:
    """Rows of {case, unit, reference, real, ratio, ...}, both sides measured now."""
    spec = dict(
        matmul_sizes=list(matmul_sizes),
        prompt_tokens=prompt_tokens,
        decode_tokens=decode_tokens,
        budget_s=budget_s,
    )
    real = _run_child(spec, real_blas=True)
    reference = _run_child(spec, real_blas=False)
    return _pair(real, reference)


def _pair(real: dict, reference: dict) -> list[dict]:
    rows = []
    # The real side only counts if its child actually got a real BLAS.
    usable = real["real_blas"] and not reference["real_blas"]
    for case, unit in real["units"].items():
        fast, slow = real["rates"][case], reference["rates"][case]
        rows.append(
            {
                "case": case,
                "unit": unit,
                "reference": slow,
                "real": fast if usable else None,
                "ratio": fast / slow if usable and slow > 0 else None,
                "blas": real["library"],
                "status": real["status"],
            }
        )
    return rows


def _run_child(spec: dict, real_blas: bool) -> dict:
    cmd = [sys.executable, "-m", "mlxkv.benchmarks.blas", json.dumps(spec)]
    done = subprocess.run(
        cmd, env=_child_env(real_blas), capture_output=True, text=True, timeout=600
    )
    if done.returncode != 0:
        side = "real" if real_blas else "reference"
        raise RuntimeError(f"{side}-BLAS benchmark child failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _child_env(real_blas: bool) -> dict:
    env = dict(os.environ)
    # The child must import this same mlxkv, installed or not.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    if real_blas:
        from mlxkv.system.blas import ENV_VAR, OFF_VALUES

        if env.get(ENV_VAR, "").strip().lower() in OFF_VALUES:
            env.pop(ENV_VAR)  # an opt-out in the shell would void the comparison
    else:
        env["MLXKV_BLAS"] = "off"
        # A preloaded BLAS would win over the opt-out; keep other preloads.
        preload = [p for p in env.get("LD_PRELOAD", "").split() if not _is_blas(p)]
        env["LD_PRELOAD"] = " ".join(preload)
    return env


def _is_blas(path: str) -> bool:
    name = os.path.basename(path)
    return "blas" in name or "blis" in name


# --- child side: runs inside `python -m mlxkv.benchmarks.blas SPEC` ---------


def _timed(fn, budget_s: float) -> float:
    """Seconds per call of fn(), looping until the budget is spent."""
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= budget_s:
            return elapsed / calls


def _matmul_rates(sizes, budget_s: float) -> dict:
    import mlx.core as mx

    rates = {}
    for n in sizes:
        a, b = mx.random.normal((n, n)), mx.random.normal((n, n))
        mx.eval(a, b, a @ b)  # warm-up: allocation, thread pools
        seconds = _timed(lambda: mx.eval(a @ b), budget_s)
        rates[f"matmul fp32 {n}x{n}"] = 2 * n**3 / seconds / 1e9
    return rates


def _build_model():
    """The bench model's architecture (benchmarks/engine.py), random weights, fp32."""
    import mlx.core as mx
    from mlx_lm.models.llama import Model, ModelArgs

    from mlxkv.benchmarks.engine import BENCH_SPEC
    from mlxkv.models.tiny import model_config

    mx.random.seed(0)
    model = Model(ModelArgs.from_dict(model_config(BENCH_SPEC)))
    mx.eval(model.parameters())
    return model


def _prefill(model, tokens):
    """mlx-lm's prefill for a prompt under one chunk: all positions, last logits."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(tokens[None], cache=cache)[:, -1, :]
    mx.eval(logits, [c.state for c in cache])
    return cache, logits


def _model_rates(prompt_tokens: int, decode_tokens: int, budget_s: float) -> dict:
    import mlx.core as mx

    model = _build_model()
    prompt = mx.random.randint(0, model.args.vocab_size, (prompt_tokens,))
    _prefill(model, prompt[:8])  # warm-up
    prefill_s = _timed(lambda: _prefill(model, prompt), budget_s)

    cache, logits = _prefill(model, prompt)
    start = time.perf_counter()
    for _ in range(decode_tokens):
        token = mx.argmax(logits, axis=-1)
        logits = model(token[:, None], cache=cache)[:, -1, :]
        mx.eval(logits)
    decode_s = (time.perf_counter() - start) / decode_tokens
    return {
        f"prefill {prompt_tokens} tok (4L llama, h1024)": prompt_tokens / prefill_s,
        "decode (4L llama, h1024)": 1 / decode_s,
    }


def _child(spec: dict) -> dict:
    from mlxkv.system.blas import load_blas

    status = load_blas()  # already ran at `import mlxkv`; this reads it
    rates = _matmul_rates(spec["matmul_sizes"], spec["budget_s"])
    units = {case: "GFLOP/s" for case in rates}
    model = _model_rates(spec["prompt_tokens"], spec["decode_tokens"], spec["budget_s"])
    rates.update(model)
    units.update({case: "tok/s" for case in model})
    return {
        "status": status.state,
        "real_blas": status.real_blas,
        "library": status.library,
        "rates": rates,
        "units": units,
    }


def format_rows(rows: list[dict]) -> str:
    """A plain-text table: case, unit, reference, real BLAS, speedup."""
    header = ("case", "unit", "reference", "real BLAS", "speedup")
    table = [header] + [
        (
            r["case"],
            r["unit"],
            f"{r['reference']:.1f}",
            "-" if r["real"] is None else f"{r['real']:.1f}",
            "-" if r["ratio"] is None else f"{r['ratio']:.1f}x",
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in table]
    if rows:
        blas = rows[0]["blas"] or f"none ({rows[0]['status']})"
        lines.append(f"real BLAS: {blas}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]))))
