"""`mlxkv bench kernels --efficiency`: how the decode kernel reads the KV pools, measured without a Mac.

Decode attention is bound by memory, and what decides its speed on a GPU
is how each simdgroup-wide load maps onto memory transactions. The MSL
harness (tests/msl, in a source checkout; needs clang-19) runs the exact
Metal source MLX generates, one OS thread per Metal thread, and records
the addresses each load of the pools reads (tests/msl/efficiency.py says
how lanes' loads are put back together). Per instantiation (one query per
row, several, each over a full-precision or a quantized pool) and pass
(K, V):

- coalescing: bytes used / bytes of the 64-byte segments touched (a
  quantized pass: its rows' records, packed words, scales and biases);
- bytes_ratio: bytes read / the minimum, each visible K or V byte once per
  KV head (for several queries: once for all of a row's queries);
- ops_per_byte: instructions the kernel executes per KV byte it needs, on a
  smaller case under valgrind (tests/msl/ops.py; None without valgrind),
  the same for both passes of an instantiation. For the one-query
  instantiations OPS_BASELINE lists, also `baseline_ops_per_byte`: the
  kernel as issue 47 found it on the same case, and `ops_ratio`, ours over
  it (goal: <= OPS_GOAL at G = 4, head dim 128, fp16).

Goals, at head dims 64, 128 and 256: coalescing >= COALESCING_GOAL and
bytes_ratio <= BYTES_GOAL, for full-precision and quantized pools alike.
It reports; it asserts nothing.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mlxkv.errors import MlxkvError

COALESCING_GOAL = 0.9
BYTES_GOAL = 1.05
OPS_GOAL = 0.6  # ops per byte against the baseline kernel, at OPS_BASELINE
OPS_BASELINE = ("float16-d128-g4-b16",)  # instantiations also counted with the baseline kernel
GOAL_HEAD_DIMS = (64, 128, 256)
_TESTS = Path(__file__).resolve().parents[2] / "tests"


def harness_modules():
    """(msl.harness, msl.efficiency, msl.paged, msl.ops) from the source checkout's tests/msl."""
    if not (_TESTS / "msl" / "efficiency.py").is_file():
        raise MlxkvError("bench kernels --efficiency runs the MSL harness of a source checkout "
                         f"(tests/msl), and {_TESTS} has none")
    if str(_TESTS) not in sys.path:
        sys.path.append(str(_TESTS))
    from msl import efficiency, harness, ops, paged

    if not harness.clang_available():
        raise MlxkvError(harness.SKIP_REASON)
    return harness, efficiency, paged, ops


def run_efficiency(instantiations=None, contexts=None, workers: int | None = None,
                   count_ops: bool | None = None) -> list[dict]:
    """Rows {instantiation, head_dim, pass, coalescing, bytes_ratio, ops_per_byte, met, ...}, two
    per decode instantiation (all of them unless `instantiations` lists msl.paged.Instantiation
    values); `count_ops`: count instructions (None: where valgrind is installed)."""
    harness_mod, efficiency, paged, ops = harness_modules()
    harness = harness_mod.shared_harness()
    chosen = list(instantiations or paged.decode_instantiations())
    contexts = tuple(contexts or efficiency.CONTEXTS)
    # Compile on every core first; the runs themselves use all cores.
    with ThreadPoolExecutor(workers or os.cpu_count()) as pool:
        list(pool.map(lambda i: efficiency.build(harness, i), chosen))
    count_ops = ops.valgrind_available() if count_ops is None else count_ops
    with ThreadPoolExecutor(workers or os.cpu_count()) as pool:
        counted = list(pool.map(lambda i: _ops(harness, ops, i) if count_ops else {}, chosen))
    rows = []
    for inst, op_counts in zip(chosen, counted):
        for row in efficiency.instantiation_rows(harness, inst, contexts=contexts):
            row = {**row, "ops_per_byte": None, **op_counts}
            rows.append({**row, "met": goal_met(row)})
    return rows


def _ops(harness, ops, inst) -> dict:
    """ops_per_byte of an instantiation, and against the baseline kernel where OPS_BASELINE says."""
    from mlxkv.attention import kernels

    found = {"ops_per_byte": ops.ops_per_byte(harness, inst)}
    if inst.id in OPS_BASELINE:
        baseline = kernels.make_kernel("paged_decode", body=ops.baseline_body())
        found["baseline_ops_per_byte"] = ops.ops_per_byte(harness, inst, decode_kernel=baseline)
        found["ops_ratio"] = found["ops_per_byte"] / found["baseline_ops_per_byte"]
    return found


def goal_met(row: dict) -> bool | None:
    """Whether a row meets the goals (None: no goal at its head dim)."""
    if row["head_dim"] not in GOAL_HEAD_DIMS:
        return None
    return row["coalescing"] >= COALESCING_GOAL and row["bytes_ratio"] <= BYTES_GOAL


def format_rows(rows: list[dict]) -> str:
    """A plain-text table and the verdict on the goals."""
    header = ("instantiation", "pass", "coalescing", "bytes read / min", "ops/byte", "baseline", "goal")
    table = [header] + [
        (r["instantiation"], r["pass"], f"{r['coalescing']:.3f}", f"{r['bytes_ratio']:.3f}x",
         "-" if r.get("ops_per_byte") is None else f"{r['ops_per_byte']:.1f}",
         f"{r['baseline_ops_per_byte']:.1f} ({r['ops_ratio']:.3f}x)" if r.get("ops_ratio") else "-",
         "-" if r["met"] is None else "met" if r["met"] else "NOT MET")
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    judged = [r for r in rows if r["met"] is not None]
    missed = sum(not r["met"] for r in judged)
    lines.append(f"goal at head dims {', '.join(map(str, GOAL_HEAD_DIMS))}: coalescing >= {COALESCING_GOAL} "
                 f"and bytes read <= {BYTES_GOAL}x the minimum: "
                 + (f"met by all {len(judged)} rows" if not missed else f"NOT met by {missed} of {len(judged)} rows"))
    for r in rows:
        if r.get("ops_ratio") and r["pass"] == "k":
            verdict = "met" if r["ops_ratio"] <= OPS_GOAL else "NOT met"
            lines.append(f"{r['instantiation']}: {r['ops_ratio']:.3f}x the baseline kernel's instructions per KV byte "
                         f"(goal <= {OPS_GOAL}x): {verdict}")
    return "\n".join(lines)
