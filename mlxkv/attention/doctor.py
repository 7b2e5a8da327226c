"""What `mlxkv doctor` says of attention: the path decode takes here, the kernels' self-check,
under `auto` the speed gate's timings and choice per (queries, batch, context) bucket, and
the KV format (`--kv-bits`): its bytes per token against float16.

No model is loaded, so the check and the gate run on a common shape (fp16,
head dim 128, 16-token blocks, 32 query heads over 8 KV heads, 32 layers:
Llama-3-8B); a model checks and times its own shape when it loads
(dispatch.choose_attention), over its own pool's format.
"""

from __future__ import annotations

import warnings

import mlx.core as mx

from mlxkv.attention.dispatch import choose_attention, resolve_attention
from mlxkv.cache.kv_format import FULL, KVFormat
from mlxkv.cache.kv_pool import KVLayout

SHAPE = dict(dtype=mx.float16, head_dim=128, v_head_dim=128, block_size=16, n_heads=32, n_kv_heads=8)
LAYERS = 32


def kv_report(kv: KVFormat = FULL) -> dict:
    """The KV format and its bytes per token on the common shape, against float16."""
    def layout(fmt):
        return KVLayout(LAYERS, SHAPE["n_kv_heads"], SHAPE["head_dim"], SHAPE["v_head_dim"], SHAPE["block_size"],
                        SHAPE["dtype"], kv=fmt)

    ours, full = layout(kv), layout(FULL)
    return {"format": ours.kv_format, "bytes_per_token": ours.bytes_per_token,
            "float16_bytes_per_token": full.bytes_per_token, "ratio": ours.bytes_per_token / full.bytes_per_token}


def kv_lines(report: dict) -> list[tuple[str, str]]:
    return [("kv format", f"{report['format']}: {report['bytes_per_token'] / 1024:g} KiB per token on Llama-3-8B's "
                          f"shape, {report['ratio']:.3f}x float16's {report['float16_bytes_per_token'] / 1024:g} KiB")]


def attention_report(run=None, timer=None, metal: bool | None = None, kv: KVFormat = FULL) -> dict:
    """{"path", "check", "gate", "why"}: the path a model of the common shape would decode on,
    over a pool of format `kv`. `run`, `timer`, `metal`: the kernel runner, the gate's timer,
    whether Metal is here (tests)."""
    metal = mx.metal.is_available() if metal is None else metal
    if resolve_attention(None, metal) == "reference":
        why = ("no Metal GPU: decode runs on the pure-MLX reference path" if not metal
               else "the reference path was asked for (MLXKV_ATTENTION)")
        return {"path": "reference", "check": None, "gate": None, "why": why}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the report says it
        choice = choose_attention(None, run=run, timer=timer, metal=metal, kv=kv, **SHAPE)
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
    if report.get("gate_source"):
        lines.append(("speed gate", f"choice {report['gate_source']}"))
    for b in report.get("gate") or []:
        queries = f"{b['queries']} queries per row, " if b["queries"] > 1 else ""
        lines.append(("speed gate", f"{queries}batch {b['batch']}, context {b['context']}: kernels "
                                    f"{b['kernel_ms']:.3f} ms, reference {b['reference_ms']:.3f} ms: {b['path']}"))
    return lines
