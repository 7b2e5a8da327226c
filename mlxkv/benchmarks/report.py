"""`mlxkv bench mac --report FILE`: every ratio the README promises for Apple GPUs, in one report.

No machine of ours is a Mac, so the first numbers from one come from a
user running this: paged kernel decode against SDPA (512/4k/16k/32k context,
batch 1 and 8, 1 and 4 queries), the SSD tier's read against a raw read, warm/cold TTFT,
decode and peak memory against mlx-lm, with the machine described (chip,
memory, OS, MLX and mlx-lm versions, the attention path, its self-check
and the speed gate's timings and stored choice per (queries, batch,
context) bucket). It writes FILE.json and FILE.md. On Linux the same suites run on the CPU path.
Given a hostfile (`--hostfile`), it adds `bench distributed`'s rows on the set that file names
(first, so a set that cannot start fails in seconds); without one it says they were not run,
and how to run them.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import mlx.core as mx

from mlxkv.attention.doctor import attention_report
from mlxkv.benchmarks.engine import _stderr
from mlxkv.benchmarks.restore_choice import CHOICE_TOKENS
from mlxkv.benchmarks.tier_gaps import GAP_TOKENS
from mlxkv.benchmarks.tiers import READ_BLOCKS, RESTORE_TOKENS
from mlxkv.errors import MlxkvError
from mlxkv.system.machine import physical_memory


@dataclass(frozen=True)
class ReportSizes:
    """How big each suite runs: the published sizes, or small ones for a quick look."""

    kernel_contexts: tuple[int, ...] = (512, 4096, 16384, 32768)
    kernel_batches: tuple[int, ...] = (1, 8)
    kernel_queries: tuple[int, ...] = (1, 4)  # a decode step, and a verify step of 3 proposals
    context: int = 2048
    decode_tokens: int = 64
    rounds: int = 7
    restore_tokens: int = RESTORE_TOKENS
    read_blocks: int = READ_BLOCKS
    gap_tokens: int = GAP_TOKENS
    choice_tokens: int = CHOICE_TOKENS
    model: str | None = None  # None: the bench model


# docs/distributed.md quotes this line (tests/benchmarks/test_bench.py holds them together)
DISTRIBUTED_NOT_RUN = ("Not run: they need a set of machines. On two Macs: "
                       "`mlxkv bench mac --report FILE --hostfile hosts.json` (add `--distributed-backend jaccl` "
                       "for Thunderbolt RDMA).")


def run_report(stem: str | Path, sizes: ReportSizes = ReportSizes(), log=None, hostfile: str | None = None,
               backend: str = "ring") -> tuple[Path, Path]:
    """Run the suites (the distributed one on `hostfile`'s set, if given) and write `stem`.json and
    `stem`.md; returns both paths."""
    from mlxkv.benchmarks.distributed import run_distributed_benchmark
    from mlxkv.benchmarks.engine import run_engine_benchmark
    from mlxkv.benchmarks.kernels import run_kernel_benchmark
    from mlxkv.benchmarks.memory import run_memory_benchmark
    from mlxkv.benchmarks.tiers import run_tiers_benchmark

    log = log or _stderr
    stem = Path(stem)
    json_path, md_path = stem.with_name(stem.name + ".json"), stem.with_name(stem.name + ".md")
    if hostfile is not None and not Path(hostfile).is_file():
        raise MlxkvError(f"no hostfile {hostfile}")
    for path in (json_path, md_path):  # before minutes of benchmarks, not after
        try:
            path.touch()
        except OSError as e:
            raise MlxkvError(f"cannot write the report {path}: {e.strerror or e}") from None
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "machine": machine_info(), "suites": {}}
    suites = {"distributed": lambda: run_distributed_benchmark(hostfile, backend)} if hostfile else {}
    suites |= {
        "kernels": lambda: run_kernel_benchmark(sizes.kernel_contexts, sizes.kernel_batches, queries=sizes.kernel_queries),
        "tiers": lambda: run_tiers_benchmark(sizes.model, sizes.restore_tokens, sizes.read_blocks, log=log,
                                             gap_tokens=sizes.gap_tokens, choice_tokens=sizes.choice_tokens),
        "engine": lambda: run_engine_benchmark(sizes.context, sizes.decode_tokens, sizes.rounds, sizes.model,
                                               log=log),
        "memory": lambda: run_memory_benchmark(sizes.model, log=log),
    }
    for name, run in suites.items():
        log(f"== {name} ==")
        report["suites"][name] = run()
    json_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    md_path.write_text(markdown(report))
    return json_path, md_path


def machine_info() -> dict:
    info = {
        "os": platform.platform(),
        "macos": platform.mac_ver()[0] or None,
        "chip": _chip(),
        "memory_gib": round(physical_memory() / 2**30, 1),
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "mlx_lm": _version("mlx-lm"),
        "mlxkv": _version("mlxkv"),
        "metal": bool(mx.metal.is_available()),
        "attention": attention_report(),
    }
    if info["metal"]:
        info["device"] = {k: v for k, v in mx.device_info().items() if isinstance(v, (int, float, str))}
    return info


def _chip() -> str:
    if sys.platform == "darwin":
        return _run(["sysctl", "-n", "machdep.cpu.brand_string"]) or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [f"# mlxkv report, {report['date']}", "", "| machine | |", "|---|---|"]
    lines += [f"| {key} | {m[key]} |" for key in ("chip", "memory_gib", "os", "macos", "mlx", "mlx_lm", "mlxkv")]
    lines.append(f"| attention | {m['attention']['path']} ({m['attention']['why']}) |")
    lines += _kernel_lines(report)
    for name in ("tiers", "engine", "memory"):
        lines += _row_lines(name, report["suites"][name])
    distributed = report["suites"].get("distributed")
    if distributed is None:
        lines += ["", "## distributed", "", DISTRIBUTED_NOT_RUN]
    else:
        lines += _row_lines("distributed", distributed) + ["", f"Model: {distributed[0]['model']}."]
        lines += [f"- {r['name']}: {r['note']}" for r in distributed if r["note"]]
    return "\n".join(lines) + "\n"


def _row_lines(name: str, rows: list[dict]) -> list[str]:
    """A suite's rows as one markdown table under its name."""
    lines = ["", f"## {name}", "", "| case | ours | baseline | against | ratio | goal | met |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['ours']:.4g} {r['unit']} | {r['baseline']:.4g} {r['unit']} "
                     f"| {r['baseline_name']} | {r['ratio']:.3f}x | {r['goal']} | {'yes' if r['met'] else 'NO'} |")
    return lines


def _kernel_lines(report: dict) -> list[str]:
    """Kernel decode against SDPA, and the speed gate's timings and choice (on Metal under auto)."""
    rows = report["suites"]["kernels"]
    lines = ["", "## Paged kernel decode / SDPA", "", "| context | batch | queries | path | paged ms | SDPA ms | ratio | goal |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        goal = f"<= {r['goal']}" if r["goal"] else "-"
        lines.append(f"| {r['context']} | {r['batch']} | {r['queries']} | {r['path']} | {r['paged_ms']:.3f} | {r['sdpa_ms']:.3f} "
                     f"| {r['ratio']:.3f}x | {goal} |")
    judged = [r for r in rows if r["goal"]]
    if judged:
        worst = max(r["ratio"] for r in judged)
        lines += ["", f"Worst kernel/SDPA ratio {worst:.3f}x: the goal (<= {judged[0]['goal']}x) is "
                      f"{'met' if worst <= judged[0]['goal'] else 'NOT met'}."]
    gate = report["machine"]["attention"].get("gate")
    lines += ["", "## Speed gate (attention=auto)", ""]
    if not gate:
        return lines + [f"Not run: {report['machine']['attention']['why']}."]
    source = report["machine"]["attention"].get("gate_source")
    if source:  # timed now, or read back from the store (gate_store.py): a stored choice was not re-timed
        lines += [f"Choices {source}.", ""]
    lines += ["| queries | batch | context | kernels ms | reference ms | kernels / reference | decodes on |",
              "|---|---|---|---|---|---|---|"]
    for b in gate:
        lines.append(f"| {b['queries']} | {b['batch']} | {b['context']} | {b['kernel_ms']:.3f} | {b['reference_ms']:.3f} "
                     f"| {b['kernel_ms'] / b['reference_ms']:.3f}x | {b['path']} |")
    return lines
