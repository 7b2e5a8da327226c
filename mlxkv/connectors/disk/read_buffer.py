"""A reusable read buffer on huge pages, where O_DIRECT reads land first.

Why: the kernel sends an O_DIRECT read to the device in requests of at
most `max_segments` physically contiguous pieces of the buffer, so into
4 KiB pages a request is small, and into 2 MiB huge pages one request
carries a whole run file. MLX allocates on pages we cannot choose, so a
read lands here and is copied into MLX memory (docs/tiers.md).
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np

HUGE_PAGE = 2 << 20
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available() -> bool:
    """Whether madvise(MADV_HUGEPAGE) can get huge pages here: Linux, with THP not set to never.

    Without them a read buffer would only add a copy.
    """
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in THP_SETTING.read_text()
    except OSError:
        return False


class ReadBuffer:
    """Anonymous memory advised for huge pages, grown as needed and reused.

    One per reader thread: a view handed out is only valid until the next
    `view` call on the same buffer.
    """

    def __init__(self):
        self._array: np.ndarray | None = None

    def view(self, size: int) -> np.ndarray:
        """`size` writable bytes starting on a huge-page boundary."""
        if self._array is None or len(self._array) < size:
            self._array = self._allocate(-(-size // HUGE_PAGE) * HUGE_PAGE)
        return self._array[:size]

    @staticmethod
    def _allocate(size: int) -> np.ndarray:
        # One huge page more than asked, so the view can start on a boundary
        # whatever address the kernel picks. The map is unmapped when the
        # last view of it goes.
        m = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass  # refused (a sandbox, say): the buffer still works, on small pages
        whole = np.frombuffer(m, np.uint8)
        at = -whole.ctypes.data % HUGE_PAGE
        return whole[at : at + size]
