"""`mlxkv bench`: ratios measured side by side in one run, never timed tests.

Each suite returns rows (plain dicts); `run_suite` prints them as a table,
or as one JSON object per line with the suite's name added.
"""

from __future__ import annotations

import importlib
import json
import time

from mlxkv.errors import MlxkvError


def _engine(args) -> tuple[list[dict], str]:
    from mlxkv.benchmarks.engine import format_rows, run_engine_benchmark

    rows = run_engine_benchmark(context=args.context, decode_tokens=args.decode_tokens)
    return rows, format_rows(rows)


def _batch(args) -> tuple[list[dict], str]:
    from mlxkv.benchmarks.batch import format_rows, run_batch_benchmark

    rows = run_batch_benchmark(prefix=getattr(args, "prefix", 1024), decode_tokens=args.decode_tokens)
    return rows, format_rows(rows)


def _kernels(args) -> tuple[list[dict], str]:
    if getattr(args, "efficiency", False):
        from mlxkv.benchmarks.kernel_efficiency import format_rows, run_efficiency

        rows = run_efficiency()
    else:
        from mlxkv.benchmarks.kernels import format_rows, run_kernel_benchmark

        rows = run_kernel_benchmark()
    return rows, format_rows(rows)


def _tiers(args) -> tuple[list[dict], str]:
    from mlxkv.benchmarks.tier_gaps import GAP_TOKENS
    from mlxkv.benchmarks.tiers import format_rows, run_tiers_benchmark

    rows = run_tiers_benchmark(remote_tier=getattr(args, "remote_tier", None),
                               gap_tokens=getattr(args, "gap_tokens", None) or GAP_TOKENS)
    return rows, format_rows(rows)


def _distributed(args) -> tuple[list[dict], str]:
    from mlxkv.benchmarks.distributed import format_rows, run_distributed_benchmark

    rows = run_distributed_benchmark(getattr(args, "hostfile", None), getattr(args, "distributed_backend", "ring"))
    return rows, format_rows(rows)


def _memory(args) -> tuple[list[dict], str]:
    from mlxkv.benchmarks.kv_formats import QUICK, FormatSizes
    from mlxkv.benchmarks.memory import format_rows, run_memory_benchmark

    rows = run_memory_benchmark(formats=QUICK if getattr(args, "quick", False) else FormatSizes())
    return rows, format_rows(rows)


def _at_defaults(module: str, run: str):
    """A suite that takes no flags: its module's `run` at its defaults, printed by its `format_rows`."""

    def suite(args) -> tuple[list[dict], str]:
        loaded = importlib.import_module(f"mlxkv.benchmarks.{module}")  # only the suite that runs loads
        rows = getattr(loaded, run)()
        return rows, loaded.format_rows(rows)

    return suite


SUITES = {
    "engine": _engine,
    "batch": _batch,
    "tiers": _tiers,
    "kernels": _kernels,
    "blas": _at_defaults("blas", "run_blas_benchmark"),
    "windows": _at_defaults("windows", "run_windows_benchmark"),
    "hybrid": _at_defaults("hybrid", "run_hybrid_benchmark"),
    "memory": _memory,
    "serve": _at_defaults("serve", "run_serve_benchmark"),
    "agents": _at_defaults("agents", "run_agents_benchmark"),
    "speculative": _at_defaults("speculative", "run_speculative_benchmark"),
    "structured": _at_defaults("structured", "run_structured_benchmark"),
    "vision": _at_defaults("vision", "run_vision_benchmark"),  # the vision extra
    "distributed": _distributed,  # 2 ranks on loopback, or a hostfile's set
}


def run_suite(args) -> int:
    """Run `args.suite` (a suite, `all`, or `mac`: the report) and print its rows; returns the exit code."""
    if getattr(args, "hostfile", None) and args.suite not in ("distributed", "mac"):
        raise MlxkvError("--hostfile is a flag of `mlxkv bench distributed` and `mlxkv bench mac`")
    if args.suite == "mac":
        from mlxkv.benchmarks.report import run_report

        json_path, md_path = run_report(args.report or f"mlxkv-report-{time.strftime('%Y%m%d-%H%M%S')}",
                                        hostfile=args.hostfile, backend=args.distributed_backend)
        print(f"wrote {json_path} and {md_path}")
        return 0
    if getattr(args, "efficiency", False) and args.suite != "kernels":
        raise MlxkvError("--efficiency is a flag of `mlxkv bench kernels`")
    if getattr(args, "quick", False) and args.suite not in ("memory", "all"):
        raise MlxkvError("--quick is a flag of `mlxkv bench memory`")
    names = list(SUITES) if args.suite == "all" else [args.suite]
    for i, name in enumerate(names):
        rows, table = SUITES[name](args)
        if args.json:
            for row in rows:
                print(json.dumps({"suite": name, **row}), flush=True)
        else:
            print(("\n" if i else "") + f"== {name} ==\n{table}", flush=True)
    return 0
