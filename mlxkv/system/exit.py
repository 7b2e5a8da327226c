"""How an `mlxkv` command leaves the process: at once, once its work is done.

A process that has loaded OpenBLAS can hang forever at exit, in
OpenBLAS's thread shutdown (`blas_thread_shutdown_` joining a worker,
called from the dynamic linker's `_dl_fini`): a command that printed its
answer and never returns. Everything mlxkv must finish (the SSD tier's
writes, the chat's database, the server's engine) is finished before the
command returns its status, so the exit flushes Python's streams and logs,
then leaves with `os._exit`, which runs no library destructor.
"""

from __future__ import annotations

import logging
import os
import sys


def exit_now(code: int) -> None:
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`mlxkv ... | head`): nothing left to say
            pass
    os._exit(code)
