"""`mlxkv bench`: ratios measured side by side in one run, never timed tests.

Each suite returns rows (plain dicts); `run_suite` prints them as a table,
or as one JSON object per line with the suite's name added.
"""

from __future__ import annotations

import json
import time


def _engine(args) -> tuple[list[dict], str]:
    from mlxkv.benchmarks.engine import format_rows, run_engine_benchmark

    rows = run_engine_benchmark(context=args.context, decode_tokens=args.decode_tokens)
    return rows, format_rows(rows)


def _blas(args) -> tuple[list[dict], str]:
    from mlxkv.benchmarks.blas import format_rows, run_blas_benchmark

    rows = run_blas_benchmark()
    return rows, format_rows(rows)


def _tiers(args) -> tuple[list[dict], str]:
    from mlxkv.benchmarks.tiers import format_rows, run_tiers_benchmark

    rows = run_tiers_benchmark()
    return rows, format_rows(rows)


def _kernels(args) -> tuple[list[dict], str]:
    from mlxkv.benchmarks.kernels import format_rows, run_kernel_benchmark

    rows = run_kernel_benchmark()
    return rows, format_rows(rows)


def _batch(args) -> tuple[list[dict], str]:
    from mlxkv.benchmarks.batch import format_rows, run_batch_benchmark

    rows = run_batch_benchmark(prefix=getattr(args, "prefix", 1024), decode_tokens=args.decode_tokens)
    return rows, format_rows(rows)


def _windows(args) -> tuple[list[dict], str]:
    from mlxkv.benchmarks.windows import format_rows, run_windows_benchmark

    rows = run_windows_benchmark()
    return rows, format_rows(rows)


def _hybrid(args) -> tuple[list[dict], str]:
    from mlxkv.benchmarks.hybrid import format_rows, run_hybrid_benchmark

    rows = run_hybrid_benchmark()
    return rows, format_rows(rows)


def _memory(args) -> tuple[list[dict], str]:
    from mlxkv.benchmarks.memory import format_rows, run_memory_benchmark

    rows = run_memory_benchmark()
    return rows, format_rows(rows)


SUITES = {"engine": _engine, "batch": _batch, "tiers": _tiers, "kernels": _kernels, "blas": _blas,
          "windows": _windows, "hybrid": _hybrid, "memory": _memory}


def run_suite(args) -> int:
    """Run `args.suite` (a suite, `all`, or `mac`: the report) and print its rows; returns the exit code."""
    if args.suite == "mac":
        from mlxkv.benchmarks.report import run_report

        json_path, md_path = run_report(args.report or f"mlxkv-report-{time.strftime('%Y%m%d-%H%M%S')}")
        print(f"wrote {json_path} and {md_path}")
        return 0
    names = list(SUITES) if args.suite == "all" else [args.suite]
    for i, name in enumerate(names):
        rows, table = SUITES[name](args)
        if args.json:
            for row in rows:
                print(json.dumps({"suite": name, **row}), flush=True)
        else:
            print(("\n" if i else "") + f"== {name} ==\n{table}", flush=True)
    return 0
