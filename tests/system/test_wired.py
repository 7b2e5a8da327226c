"""Generation holds the wired limit on Metal, as mlx-lm does, and does nothing elsewhere."""

from __future__ import annotations

import logging

from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.models.loader import load_model
from mlxkv.system.wired import WiredLimit


class FakeDevice:
    def __init__(self, metal: bool = True, recommended: int = 8 << 30):
        self.metal, self.recommended, self.limit, self.calls = metal, recommended, 0, []

    def is_metal(self) -> bool:
        return self.metal

    def recommended_bytes(self) -> int:
        return self.recommended

    def set_wired_limit(self, limit: int) -> int:
        self.calls.append(("set", limit))
        old, self.limit = self.limit, limit
        return old

    def synchronize(self) -> None:
        self.calls.append(("sync",))


def engine_on(device, llama_dir) -> Engine:
    return Engine(load_model(llama_dir), CacheConfig(num_blocks=64, memory_tier_bytes=0), device=device)


def test_generation_wires_memory_for_its_length_on_metal(llama_dir):
    device = FakeDevice()
    engine = engine_on(device, llama_dir)
    engine.generate([3, 4, 5], max_tokens=5)
    # Raised once for the whole run of steps, put back after the device finished.
    assert device.calls == [("set", 8 << 30), ("sync",), ("set", 0)]
    engine.generate_batch([[3, 4, 5], [6, 7]], max_tokens=4)
    assert device.calls[3:] == [("set", 8 << 30), ("sync",), ("set", 0)] and device.limit == 0


def test_without_metal_nothing_is_wired(llama_dir):
    device = FakeDevice(metal=False)
    engine_on(device, llama_dir).generate([3, 4, 5], max_tokens=5)
    assert device.calls == []


def test_a_model_near_the_working_set_is_said_once(caplog):
    device = FakeDevice(recommended=100)
    wired = WiredLimit(model_bytes=95, device=device)
    with caplog.at_level(logging.WARNING, logger="mlxkv"):
        wired.hold()
        wired.hold()  # already held: no second raise, no second warning
        wired.release()
        wired.release()
    assert [r.getMessage() for r in caplog.records if "working set" in r.getMessage()] != []
    assert len(caplog.records) == 1 and device.calls == [("set", 100), ("sync",), ("set", 0)]
