"""What `mlxkv doctor` says of attention: the path decode takes here, and the kernels' self-check.

No model is loaded, so the check runs on a common shape (fp16, head dim
128, 16-token blocks, 4 query heads per KV head); a model checks its own
shape when it loads (dispatch.choose_attention).
"""

from __future__ import annotations

import warnings

import mlx.core as mx

from mlxkv.attention.dispatch import choose_attention, resolve_attention

SHAPE = dict(dtype=mx.float16, head_dim=128, v_head_dim=128, block_size=16, n_heads=32, n_kv_heads=8)


def attention_report(run=None) -> dict:
    """{"path", "check", "why"}: the path a model of the common shape would decode on."""
    if resolve_attention(None) == "reference":
        why = ("no Metal GPU: decode runs on the pure-MLX reference path" if not mx.metal.is_available()
               else "the reference path was asked for (MLXKV_ATTENTION)")
        return {"path": "reference", "check": None, "why": why}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the report says it
        choice = choose_attention(None, run=run, **SHAPE)
    why = ("the Metal kernels passed their self-check" if choice.path == "kernel"
           else "the Metal kernels failed their self-check: decode runs on the reference path")
    return {**choice.as_dict(), "why": why}


def attention_lines(report: dict) -> list[tuple[str, str]]:
    """The report as `mlxkv doctor` lines."""
    lines = [("attention", f"{report['path']} ({report['why']})")]
    check = report["check"]
    if check is not None:
        reason = f": {check['reason']}" if check["reason"] else ""
        lines.append(("kernel check", f"{'passed' if check['ok'] else 'FAILED'}: {check['instantiation']}{reason}"))
    return lines
