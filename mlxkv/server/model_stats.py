"""Each served model's state as plain data (/v1/cache/stats) and Prometheus lines (/metrics)."""

from __future__ import annotations

from mlxkv.server.model_registry import LOADED, ModelRegistry, ModelSlot
from mlxkv.server.metrics import _metric, _number


def model_stats(registry: ModelRegistry, slot: ModelSlot) -> dict:
    engine = slot.backend.stats() if slot.backend is not None else {}
    idle = registry.idle_s(slot)
    return {
        "source": slot.spec.source,
        "state": slot.state,
        "loaded": slot.state == LOADED,
        "pinned": slot.spec.pin,
        "keep_alive_s": None if slot.spec.keep_alive_s in (None, float("inf")) else slot.spec.keep_alive_s,
        "open_requests": slot.open_requests if slot.state == LOADED else 0,
        "pool": engine.get("pool"),
        "bytes": slot.footprint,
        "replies": slot.replies,
        "cached_tokens": dict(slot.cached_tokens),
        "image_tokens": slot.image_tokens,
        "cached_image_tokens": slot.cached_image_tokens,
        "loads": slot.loads,
        "unloads": slot.unloads,
        "last_load_s": slot.load_s,
        "idle_s": None if idle is None else round(idle, 3),
        "error": slot.error,
    }


def model_lines(rows: dict[str, dict]) -> list[str]:
    """Per model, labelled model="NAME": loaded, loads, unloads, bytes, replies, cached tokens, image tokens,
    idle seconds."""
    names = sorted(rows)
    lines = _metric("mlxkv_model_loaded", "gauge", "1 while the model is loaded",
                    [f'{{model="{n}"}} {int(rows[n]["loaded"])}' for n in names])
    for key, kind, help_text in (("loads", "counter", "times the model was loaded"),
                                 ("unloads", "counter", "times the model was unloaded"),
                                 ("replies", "counter", "replies the model finished"),
                                 ("image_tokens", "counter", "image tokens in the model's prompts"),
                                 ("cached_image_tokens", "counter", "image tokens a prefix hit served"),
                                 ("bytes", "gauge", "bytes of weights and pool budget, as last loaded")):
        name = f"mlxkv_model_{key}" + ("_total" if kind == "counter" else "")
        lines += _metric(name, kind, help_text, [f'{{model="{n}"}} {rows[n][key]}' for n in names])
    lines += _metric("mlxkv_model_cached_tokens_total", "counter", "prompt tokens reused, by model and tier",
                     [f'{{model="{n}",tier="{t}"}} {c}' for n in names for t, c in sorted(rows[n]["cached_tokens"].items())])
    lines += _metric("mlxkv_model_pool_blocks", "gauge", "a loaded model's KV pool blocks in use",
                     [f'{{model="{n}"}} {rows[n]["pool"].get("in_use", 0)}' for n in names if rows[n]["pool"]])
    lines += _metric("mlxkv_model_idle_seconds", "gauge", "seconds since the model's last request",
                     [f'{{model="{n}"}} {_number(rows[n]["idle_s"])}' for n in names if rows[n]["idle_s"] is not None])
    return lines
