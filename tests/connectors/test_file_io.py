"""The SSD tier's read backend per OS: which one is chosen, and what the macOS one asks
of fcntl (F_NOCACHE, F_RDADVISE), driven here through an injected fcntl."""

from __future__ import annotations

import fcntl
import logging
import os
import struct

import pytest

from mlxkv.connectors.disk.cache_dir import cache_info
from mlxkv.connectors.disk.file_io import F_NOCACHE, F_RDADVISE, BufferedIO, LinuxIO, MacIO, choose_io
from test_disk_connector import chain, disk_stats, make_kv, open_disk, same_bits, write_runs


class MacFcntl:
    """fcntl as macOS has it, recording each call: F_NOCACHE and F_RDADVISE, no O_DIRECT."""

    def __init__(self, refuse: bool = False):
        self.calls, self.refuse = [], refuse

    def fcntl(self, fd, cmd, arg=0):
        self.calls.append((cmd, arg, os.fstat(fd).st_size))
        if self.refuse:
            raise OSError(45, "Operation not supported")
        return 0


@pytest.mark.parametrize(("platform", "kind"), [("darwin", MacIO), ("linux", LinuxIO), ("freebsd14", BufferedIO)])
def test_the_backend_is_chosen_by_os_and_logged(platform, kind, caplog):
    with caplog.at_level(logging.INFO, logger="mlxkv"):
        io = choose_io(platform, fcntl=MacFcntl())
    assert isinstance(io, kind)
    assert f"SSD tier reads with {io.name}" in caplog.text
    assert io.huge_pages == (kind is LinuxIO)


@pytest.mark.parametrize("refuse", [False, True], ids=["macos", "fcntl-refused"])
def test_the_macos_reader_skips_the_cache_and_reads_ahead_bit_exact(tmp_path, refuse):
    hashes = chain(40)
    with open_disk(tmp_path) as disk:
        write_runs(disk, hashes)
    fake = MacFcntl(refuse)
    with open_disk(tmp_path, read_io=MacIO(fcntl=fake)) as disk:
        assert disk.health()["read_backend"] == "macos-f_nocache"
        loaded = disk.load_blocks(hashes)
        assert [b.block_hash for b in loaded] == hashes
        assert all(same_bits(b.kv, make_kv(i)) for i, b in enumerate(loaded))
        assert disk.reader.direct_io is False and disk.reader.huge_pages is False
        assert disk_stats(disk)["corrupt"] == 0
    # Per file read (40 blocks: 3 files): F_NOCACHE on, then read-ahead of the whole file.
    nocache = [c for c in fake.calls if c[0] == F_NOCACHE]
    advise = [c for c in fake.calls if c[0] == F_RDADVISE]
    assert len(nocache) == 3 and all(arg == 1 for _, arg, _ in nocache)
    assert advise and all(struct.unpack("qi4x", arg) == (0, size) for _, arg, size in advise)
    assert not any(c[0] in (fcntl.F_SETFL, fcntl.F_GETFL) for c in fake.calls)  # no O_DIRECT flags


def test_cache_info_names_the_read_backend(tmp_path):
    assert cache_info(tmp_path)["read_backend"] == choose_io().name
