"""What the machine has, for checks before allocations that could not fit.

MLX does not fail an allocation it cannot make: the process dies with a
segmentation fault. So a size a user asks for (a KV pool, a tiny model)
is checked against physical memory first.
"""

from __future__ import annotations

import os


def physical_memory() -> int:
    """Bytes of RAM (unified memory on Apple silicon); 8 GiB where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 8 << 30
