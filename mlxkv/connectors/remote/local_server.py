"""A redis-server (or valkey-server) of its own: a free loopback port, its own config and data directory.

For `mlxkv bench tiers` and the tests, which measure and fault a real
server (kill it, pause it, fill it), never a user's. Persistence is off,
as docs/tiers.md advises for a cache.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from mlxkv.errors import MlxkvError

BINARIES = ("redis-server", "valkey-server")
START_TIMEOUT_S = 10.0


def server_binary() -> str | None:
    return next((path for name in BINARIES if (path := shutil.which(name))), None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRedisServer:
    def __init__(self, directory: str | os.PathLike, *, password: str | None = None, port: int | None = None,
                 settings: dict[str, str] | None = None):
        self.dir = Path(directory)
        self.password = password
        self.port = port or free_port()
        self.settings = settings or {}
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def url_with(self, password: str | None) -> str:
        return f"redis://{':' + password + '@' if password else ''}127.0.0.1:{self.port}/0"

    def config(self) -> str:
        lines = {"bind": "127.0.0.1", "port": str(self.port), "dir": str(self.dir), "save": '""',
                 "appendonly": "no", "daemonize": "no", "logfile": str(self.dir / "server.log"),
                 "protected-mode": "yes", **self.settings}
        if self.password:
            lines["requirepass"] = self.password
        return "".join(f"{k} {v}\n" for k, v in lines.items())

    def start(self) -> LocalRedisServer:
        binary = server_binary()
        if binary is None:
            raise MlxkvError("no redis-server or valkey-server on PATH (Debian: apt-get install redis-server)")
        self.dir.mkdir(parents=True, exist_ok=True)
        conf = self.dir / "redis.conf"
        conf.write_text(self.config())
        self.process = subprocess.Popen([binary, str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise MlxkvError(f"redis-server exited at start: {self._log_tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64):  # +PONG, or -NOAUTH with a password: either way it serves
                        return
            except OSError:
                time.sleep(0.02)
        raise MlxkvError(f"redis-server did not answer on port {self.port} in {START_TIMEOUT_S:.0f} s")

    def _log_tail(self) -> str:
        try:
            return (self.dir / "server.log").read_text().strip().splitlines()[-1]
        except (OSError, IndexError):
            return "(no log)"

    def kill(self) -> None:
        """Gone at once, as a crash or a pulled cable: no reply to anything in flight."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def pause(self) -> None:
        """Stopped but holding its port: connections open and nothing answers (a hung server)."""
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.send_signal(signal.SIGCONT)
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None

    def __enter__(self) -> LocalRedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
