"""Wired memory while generating, as mlx-lm does on Apple GPUs.

On Metal, memory the GPU uses can be paged out unless it is wired; mlx-lm
raises the wired limit to the device's recommended working set for the
length of a generation and puts it back after. The batch loop does the
same around each run of steps (from the first step after idle to the step
that leaves it idle). Elsewhere it does nothing. The device is an
interface so tests here drive it with a fake.
"""

from __future__ import annotations

import logging
from typing import Protocol

import mlx.core as mx

log = logging.getLogger(__name__)


class Device(Protocol):
    def is_metal(self) -> bool: ...

    def recommended_bytes(self) -> int: ...

    def set_wired_limit(self, limit: int) -> int:
        """Set the limit; returns the one it replaces."""

    def synchronize(self) -> None: ...


class MLXDevice:
    """The real one: MLX's Metal device."""

    def is_metal(self) -> bool:
        return mx.metal.is_available()

    def recommended_bytes(self) -> int:
        return int(mx.device_info()["max_recommended_working_set_size"])

    def set_wired_limit(self, limit: int) -> int:
        return mx.set_wired_limit(limit)

    def synchronize(self) -> None:
        mx.synchronize()


class WiredLimit:
    """Holds the wired limit at the recommended working set while held; a no-op without Metal."""

    def __init__(self, model_bytes: int = 0, device: Device | None = None):
        self.device = device or MLXDevice()
        self.model_bytes = model_bytes
        self._old: int | None = None

    @property
    def held(self) -> bool:
        return self._old is not None

    def hold(self) -> None:
        if self.held or not self.device.is_metal():
            return
        recommended = self.device.recommended_bytes()
        if self.model_bytes > 0.9 * recommended:
            log.warning("the model takes %d MiB, close to the GPU's recommended working set of %d MiB: "
                        "generation may be slow", self.model_bytes >> 20, recommended >> 20)
        self._old = self.device.set_wired_limit(recommended)

    def release(self) -> None:
        """Put the old limit back, once the device has finished (never mid-evaluation)."""
        if not self.held:
            return
        self.device.synchronize()
        self.device.set_wired_limit(self._old)
        self._old = None
