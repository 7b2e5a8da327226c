"""`mlxkv serve`: one engine thread and one pool behind an HTTP server.

The socket is bound before the model loads, so a port in use is a one-line
error at once, not after a minute of loading. uvicorn serves the app on the
calling thread (the CLI) or on a thread of its own (tests, benchmarks).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import threading
import time
import warnings
from dataclasses import dataclass

import uvicorn

from mlxkv.config import CacheConfig
from mlxkv.errors import MlxkvError, MlxkvWarning
from mlxkv.server.backend import DEFAULT_MAX_OPEN, DEFAULT_MAX_TOKENS, ServingBackend
from mlxkv.host.engine_thread import EngineThread, load_engine
from mlxkv.server.http_app import KEEPALIVE_S, AppConfig, build_app
from mlxkv.server.http_support import DEFAULT_MAX_BODY_BYTES
from mlxkv.server.reply_ids import DEFAULT_KEPT
from mlxkv.vision.images import MAX_IMAGE_PIXELS
from mlxkv.vision.prompt import MAX_IMAGES

log = logging.getLogger(__name__)

API_KEY_ENV = "MLXKV_API_KEY"
# Open streams get this long to finish when the server stops; then each ends
# with its API's final event. uvicorn's own limit comes STOP_MARGIN_S later,
# so it never has to cancel a handler (a traceback per stream, no final event).
GRACEFUL_SHUTDOWN_S = 5.0
STOP_MARGIN_S = 3.0


@dataclass
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_open: int = DEFAULT_MAX_OPEN
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    reply_ids_kept: int = DEFAULT_KEPT
    reply_cap: int | None = None  # every reply at most this long (agents ask for 32000)
    keepalive_s: float = KEEPALIVE_S
    shutdown_grace_s: float = GRACEFUL_SHUTDOWN_S
    max_image_pixels: int = MAX_IMAGE_PIXELS  # per image, width x height (docs/vision.md)
    max_images: int = MAX_IMAGES  # per request
    allow_image_urls: bool = False  # fetch http(s) image URLs (off: a client could make the server reach hosts)

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise MlxkvError(f"port must be between 0 and 65535, got {self.port}")
        if self.api_key == "":
            raise MlxkvError("the API key is empty; give a key or leave --api-key out")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise MlxkvError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def warn_if_exposed(host: str, api_key: str | None) -> None:
    if not is_loopback(host) and api_key is None:
        warnings.warn(MlxkvWarning(f"serving on {host}, beyond this machine, without an API key; "
                                   f"anyone who can reach it can use it (set --api-key or {API_KEY_ENV})"))


class Server:
    """A model served over HTTP until `close()`: `Server.load(model, cache)`,
    or `Server(thread, name)` around an engine thread already started."""

    def __init__(self, thread: EngineThread, name: str, options: ServerOptions | None = None,
                 sock: socket.socket | None = None):
        o = self.options = options or ServerOptions()
        self.engine = thread
        self.socket = sock or bind(o.host, o.port)
        self.port = self.socket.getsockname()[1]
        try:
            self.backend = ServingBackend(thread, name, max_open=o.max_open, default_max_tokens=o.max_tokens,
                                          reply_ids_kept=o.reply_ids_kept, reply_cap=o.reply_cap,
                                          image_limits=(o.max_image_pixels, o.max_images),
                                          allow_image_urls=o.allow_image_urls)
        except BaseException:
            self._close_engine()
            raise
        app = build_app(self.backend, AppConfig(o.api_key, o.max_body_bytes, o.temperature, o.keepalive_s))
        config = uvicorn.Config(app, log_config=None, access_log=False,
                                timeout_graceful_shutdown=o.shutdown_grace_s + STOP_MARGIN_S)
        self.uvicorn = _Uvicorn(config, self._stopping)
        self._thread: threading.Thread | None = None

    @classmethod
    def load(cls, model: str, cache: CacheConfig, options: ServerOptions | None = None, *,
             load=load_engine) -> Server:
        """Bind first (a port in use fails at once), then load `model` on its engine thread."""
        options = options or ServerOptions()
        warn_if_exposed(options.host, options.api_key)
        sock = bind(options.host, options.port)
        return cls(EngineThread(model, cache, load=load).start(), model, options, sock)

    @property
    def url(self) -> str:
        host = self.options.host
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"

    def startup_line(self) -> str:
        info = self.backend.info
        context = "" if info.max_context is None else f", context {info.max_context} tokens"
        return f"mlxkv serve: {self.url} (model {info.name}{context}; cache: {info.tiers})"

    def _stopping(self) -> None:
        """On the event loop, as uvicorn begins to stop: open replies end at the grace period's end."""
        open_requests = self.engine.open_requests
        if open_requests:
            log.info("stopping: %d open requests get %.0f s to finish", open_requests, self.options.shutdown_grace_s)
        self.backend.stop_at = time.monotonic() + self.options.shutdown_grace_s

    def serve_forever(self) -> None:
        """Serve on this thread until interrupted (Ctrl-C), then close."""
        self.uvicorn.on_started = lambda: print(self.startup_line(), flush=True)
        try:
            self.uvicorn.run(sockets=[self.socket])
        finally:
            self._close_engine()

    def start(self) -> Server:
        """Serve on a background thread; returns once it accepts connections."""
        self._thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [self.socket]},
                                        name="mlxkv-http", daemon=True)
        self._thread.start()
        while not self.uvicorn.started and self._thread.is_alive():
            time.sleep(0.01)
        return self

    def close(self) -> None:
        self.uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(self.options.shutdown_grace_s + STOP_MARGIN_S + 5)
        self._close_engine()

    def _close_engine(self) -> None:
        backend = getattr(self, "backend", None)
        if backend is not None:
            backend.close()
        self.engine.close()  # finishes the SSD tier's writes
        self.socket.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Uvicorn(uvicorn.Server):
    """uvicorn re-raises the Ctrl-C or SIGTERM that stopped it, once it has
    stopped: SIGTERM's default action would then end the process before the
    engine closes (and the SSD tier's last writes finish). Here a signal only
    stops the serving; serve_forever then closes the engine and the command
    exits 0. (_captured_signals is uvicorn's; the restart test covers it.)

    `stopping` runs as the shutdown begins, `on_started` once it listens."""

    def __init__(self, config: uvicorn.Config, stopping):
        super().__init__(config)
        self.stopping = stopping
        self.on_started = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.on_started is not None:
            self.on_started()

    async def shutdown(self, sockets=None) -> None:
        self.stopping()
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        with super().capture_signals():
            try:
                yield
            finally:
                self._captured_signals.clear()


def log_serving(level: str) -> None:
    """The server's log on stderr at `level`: at info, one line per request
    (access log); uvicorn's own lines the same way, one line each."""
    from mlxkv.system import logs

    handler = logs.log_to_stderr(logging.getLevelName(level.upper()))
    server_log = logging.getLogger("uvicorn")
    server_log.handlers = [handler]
    server_log.setLevel(logging.WARNING)
    server_log.propagate = False


def api_key_from(flag: str | None) -> str | None:
    return flag if flag is not None else (os.environ.get(API_KEY_ENV) or None)
