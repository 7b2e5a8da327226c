"""How big the GPU is: decode launches split rows into partitions until their grid fills it.

MLX reports no core count. `mx.device_info()["architecture"]` names the GPU
(`applegpu_g13s`: M1 Pro), and its last letter the class of die: g or p the
base chip, s Pro, c Max, d Ultra. Each class is taken at its fewest cores, so
an estimate never splits rows more than the GPU needs. Off a Mac (the MSL
harness) and for a name this does not know, DEFAULT_CORES: the 1024-simdgroup
target the kernels used before (MLX's sdpa_vector's grid for Llama-3-8B at batch 1).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

SIMDGROUPS_PER_CORE = 32  # four 8-simdgroup threadgroups resident per core hide memory latency
CORES_BY_CLASS = {"g": 8, "p": 8, "s": 14, "c": 24, "d": 48}
DEFAULT_CORES = 32


@dataclass(frozen=True)
class GPUSize:
    cores: int

    def __post_init__(self):
        if self.cores < 1:
            raise ValueError(f"a GPU has at least one core, not {self.cores}")

    @property
    def target_simdgroups(self) -> int:
        """Simdgroups a decode grid needs to keep every core busy."""
        return self.cores * SIMDGROUPS_PER_CORE


def from_device_info(info: dict) -> GPUSize:
    """The size of the GPU `mx.device_info()` describes (see the module docstring)."""
    arch = str(info.get("architecture", ""))
    if arch.startswith("applegpu_") and arch[-1:] in CORES_BY_CLASS:
        return GPUSize(CORES_BY_CLASS[arch[-1]])
    return GPUSize(DEFAULT_CORES)


@functools.cache
def current() -> GPUSize:
    """This machine's GPU, asked once per process (it does not change)."""
    import mlx.core as mx

    if not mx.metal.is_available():
        return GPUSize(DEFAULT_CORES)
    return from_device_info(mx.device_info())
