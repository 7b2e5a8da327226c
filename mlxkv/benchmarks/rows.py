"""Benchmark rows: one dict per measured ratio, and the table that prints them."""

from __future__ import annotations

import math


def row(name, unit, ours, baseline, baseline_name, goal, met, note="", ratio=None, **extra) -> dict:
    if ratio is None:
        ratio = ours / baseline if baseline else math.nan
    return dict(name=name, unit=unit, ours=ours, baseline=baseline, baseline_name=baseline_name,
                ratio=ratio, goal=goal, met=met, note=note, **extra)


def _num(x: float) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x:.0f}" if abs(x) >= 1000 else f"{x:.1f}" if abs(x) >= 100 else f"{x:.2f}"


def format_rows(rows: list[dict]) -> str:
    """A plain-text table, the model line, then notes."""
    header = ("case", "unit", "mlxkv", "baseline", "against", "ratio", "goal", "met")
    table = [header] + [
        (r["name"], r["unit"], _num(r["ours"]), _num(r["baseline"]), r["baseline_name"],
         f"{r['ratio']:.3f}x" if math.isfinite(r["ratio"]) else "-", r["goal"], "yes" if r["met"] else "NO")
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    if rows:
        lines.insert(0, f"model: {rows[0]['model']}")
        lines += [f"  {r['name']}: {r['note']}" for r in rows if r["note"]]
    return "\n".join(lines)
