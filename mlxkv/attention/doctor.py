"""What `mlxkv doctor` says of attention: the path decode takes here, the kernels' self-check,
and under `auto` the speed gate's timings and choice per (queries, batch, context) bucket.

No model is loaded, so the check and the gate run on a common shape (fp16,
head dim 128, 16-token blocks, 32 query heads over 8 KV heads: Llama-3-8B);
a model checks and times its own shape when it loads (dispatch.choose_attention).
"""

from __future__ import annotations

import warnings

import mlx.core as mx

from mlxkv.attention.dispatch import choose_attention, resolve_attention

SHAPE = dict(dtype=mx.float16, head_dim=128, v_head_dim=128, block_size=16, n_heads=32, n_kv_heads=8)


def attention_report(run=None, timer=None, metal: bool | None = None) -> dict:
    """{"path", "check", "gate", "why"}: the path a model of the common shape would decode on.
    `run`, `timer`, `metal`: the kernel runner, the gate's timer, whether Metal is here (tests)."""
    metal = mx.metal.is_available() if metal is None else metal
    if resolve_attention(None, metal) == "reference":
        why = ("no Metal GPU: decode runs on the pure-MLX reference path" if not metal
               else "the reference path was asked for (MLXKV_ATTENTION)")
        return {"path": "reference", "check": None, "gate": None, "why": why}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the report says it
        choice = choose_attention(None, run=run, timer=timer, metal=metal, **SHAPE)
    return {**choice.as_dict(), "why": _why(choice)}


def _why(choice) -> str:
    if choice.path == "reference":
        return "the Metal kernels failed their self-check: decode runs on the reference path"
    if choice.gate is None:
        return "the Metal kernels passed their self-check and serve every decode (asked for: no speed gate)"
    used = [b for b in choice.gate.buckets if b.path == "kernel"]
    return (f"the Metal kernels passed their self-check; the speed gate uses them in {len(used)} of "
            f"{len(choice.gate.buckets)} (queries, batch, context) buckets, where they were faster")


def attention_lines(report: dict) -> list[tuple[str, str]]:
    """The report as `mlxkv doctor` lines."""
    lines = [("attention", f"{report['path']} ({report['why']})")]
    check = report["check"]
    if check is not None:
        reason = f": {check['reason']}" if check["reason"] else ""
        lines.append(("kernel check", f"{'passed' if check['ok'] else 'FAILED'}: {check['instantiation']}{reason}"))
    for b in report.get("gate") or []:
        queries = f"{b['queries']} queries per row, " if b["queries"] > 1 else ""
        lines.append(("speed gate", f"{queries}batch {b['batch']}, context {b['context']}: kernels "
                                    f"{b['kernel_ms']:.3f} ms, reference {b['reference_ms']:.3f} ms: {b['path']}"))
    return lines
