"""A second proxy of a kernel's speed: the instructions it executes per KV byte it reads.

Decode is now bound by arithmetic more than by memory (issue 47), so the
harness also counts what the kernel computes. It runs one launch under
valgrind's callgrind and sums the instructions (Ir) executed in the kernel
function itself and in the maths it calls (exp, exp2): what the GPU would
execute too. The emulation around it is left out: the barrier and simd
exchanges of the runtime (a few instructions on a GPU, thousands here),
fp16/bf16 conversions (free on a GPU, calls here) and the thread setup.

ops_per_byte = those instructions / the KV bytes the launch needs (every
visible K and V byte once per KV head, as efficiency.py's minimum). x86
instructions of a -O1 build are not Apple GPU instructions: the number is
for comparing two kernels on the same case (today's against the baseline
in baseline_paged_decode.metal), not for its own value.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
OPS_CONTEXTS = (200, 67)  # two rows over partial blocks: many tokens per simdgroup, a few seconds under valgrind
_COUNTED = re.compile(r"custom_kernel_mlxkv|mlxkv_copy_records|mlxkv_dequantize|mlxkv_quant|mlxkv_packed_bits|\bexp2?f?\b|__exp")


def valgrind_available() -> bool:
    return shutil.which("valgrind") is not None and shutil.which("callgrind_annotate") is not None


def baseline_body() -> str:
    """The decode kernel's body as issue 47 found it."""
    return (HERE / "baseline_paged_decode.metal").read_text()


def instructions(harness, launch) -> int:
    """Instructions the kernel executes for `launch` (see the module docstring), counted once
    per launch in the harness: valgrind takes seconds."""
    return harness.remembered("instructions", launch, lambda: _count(harness, launch))


def _count(harness, launch) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        harness.run_under(launch, ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                                   "--max-threads=1000", "--quiet"])
        report = subprocess.run(["callgrind_annotate", "--inclusive=no", "--threshold=100", str(out)],
                                capture_output=True, text=True, check=True).stdout
    total = 0
    for line in report.splitlines():
        m = re.match(r"\s*([\d,]+)\s+\(\s*[\d.]+%\)\s+(.*)$", line)
        if m and "PROGRAM TOTALS" not in m.group(2) and _COUNTED.search(m.group(2).split(" [")[0]):
            total += int(m.group(1).replace(",", ""))
    if total == 0:
        raise RuntimeError("callgrind counted no instruction in the kernel")
    return total


def ops_per_byte(harness, inst, contexts=OPS_CONTEXTS, decode_kernel=None) -> float:
    """Kernel instructions per KV byte of one instantiation's launch on a case of `contexts`."""
    from msl import efficiency

    case, launch = efficiency._launch(inst, contexts, decode_kernel)
    kv_bytes = 2 * sum(contexts) * efficiency.N_KV_HEADS * efficiency._minimum_row_bytes(case, inst)
    return instructions(harness, launch) / kv_bytes
