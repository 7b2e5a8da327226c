"""How the SSD tier reads a file, per operating system, behind one interface.

- Linux: O_DIRECT where the file system takes it (DMA, no page-cache copy,
  no second copy of the tier in the page cache), into huge pages
  (read_buffer.py); posix_fadvise(WILLNEED) to queue reads through the
  cache where O_DIRECT is refused.
- macOS: F_NOCACHE on the descriptor (reads skip the unified buffer cache,
  with no alignment rules) and F_RDADVISE for read-ahead of the whole file;
  no huge pages.
- Anything else: plain reads through the cache.

The `fcntl` and `os` modules are parameters, so the tests here drive the
macOS backend with fakes and check its calls.
"""

from __future__ import annotations

import fcntl as _fcntl
import logging
import os as _os
import struct
import sys

log = logging.getLogger(__name__)

# <sys/fcntl.h> on macOS; Python's fcntl module names F_NOCACHE but not F_RDADVISE.
F_RDADVISE = 44
F_NOCACHE = 48


class LinuxIO:
    name = "linux-o_direct"
    huge_pages = True

    def __init__(self, fcntl=_fcntl, os=_os):
        self.fcntl, self.os = fcntl, os

    def prepare(self, fd: int, size: int) -> bool:
        """Switch to O_DIRECT; False where the OS or file system has none (tmpfs). True: reads
        must be aligned (run_file.ALIGN)."""
        if not hasattr(self.os, "O_DIRECT"):
            return False
        try:
            self.fcntl.fcntl(fd, self.fcntl.F_SETFL, self.fcntl.fcntl(fd, self.fcntl.F_GETFL) | self.os.O_DIRECT)
        except OSError:
            return False
        return True

    def undirect(self, fd: int) -> None:
        """Back to reads through the cache (the device wanted a larger alignment)."""
        self.fcntl.fcntl(fd, self.fcntl.F_SETFL, self.fcntl.fcntl(fd, self.fcntl.F_GETFL) & ~self.os.O_DIRECT)

    def prefetch(self, paths) -> None:
        """Queue every file's I/O at once (posix_fadvise WILLNEED), for reads through the cache."""
        for path in paths:
            _each_fd(self.os, path, lambda fd: self.os.posix_fadvise(fd, 0, 0, self.os.POSIX_FADV_WILLNEED))


class MacIO:
    name = "macos-f_nocache"
    huge_pages = False

    def __init__(self, fcntl=_fcntl, os=_os):
        self.fcntl, self.os = fcntl, os

    def prepare(self, fd: int, size: int) -> bool:
        """F_NOCACHE, then read-ahead of the whole file. Never aligned reads: False."""
        try:
            self.fcntl.fcntl(fd, F_NOCACHE, 1)
        except OSError:
            pass  # only a hint: the read goes through the cache
        self._advise(fd, size)
        return False

    def undirect(self, fd: int) -> None:
        pass

    def prefetch(self, paths) -> None:
        for path in paths:
            _each_fd(self.os, path, lambda fd: self._advise(fd, self.os.fstat(fd).st_size))

    def _advise(self, fd: int, size: int) -> None:
        # struct radvisory { off_t ra_offset; int ra_count; }, padded to 16 bytes.
        try:
            self.fcntl.fcntl(fd, F_RDADVISE, struct.pack("qi4x", 0, min(size, 2**31 - 1)))
        except OSError:
            pass  # only a hint


class BufferedIO:
    name = "buffered"
    huge_pages = False

    def prepare(self, fd: int, size: int) -> bool:
        return False

    def undirect(self, fd: int) -> None:
        pass

    def prefetch(self, paths) -> None:
        pass


def choose_io(platform: str = sys.platform, fcntl=_fcntl, os=_os):
    """The read backend for this OS; logged, and shown by `mlxkv cache info`."""
    if platform == "darwin":
        io = MacIO(fcntl, os)
    elif platform.startswith("linux"):
        io = LinuxIO(fcntl, os)
    else:
        io = BufferedIO()
    log.info("SSD tier reads with %s", io.name)
    return io


def _each_fd(os, path, call) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # the read will find it gone
    try:
        call(fd)
    except OSError:
        pass  # only a hint
    finally:
        os.close(fd)
