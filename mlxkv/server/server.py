"""`mlxkv serve`: one engine thread and one pool behind an HTTP server.

The socket is bound before the model loads, so a port in use is a one-line
error at once, not after a minute of loading. uvicorn serves the app on the
calling thread (the CLI) or on a thread of its own (tests, benchmarks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import logging
import os
import socket
import threading
import time
import warnings
from dataclasses import dataclass, field

import uvicorn

from mlxkv.config import DEFAULT_KV_GROUP_SIZE, CacheConfig
from mlxkv.errors import MlxkvError, MlxkvWarning
from mlxkv.server.backend import DEFAULT_MAX_OPEN, DEFAULT_MAX_TOKENS, ServingBackend, short_name
from mlxkv.server.encoder_backend import EncoderBackend
from mlxkv.host.encoder_thread import EncoderThread
from mlxkv.host.engine_thread import EngineThread, load_engine
from mlxkv.models.encoder import checkpoint_config, encoder_family
from mlxkv.server.http_app import KEEPALIVE_S, AppConfig, build_app
from mlxkv.server.metrics import ServerMetrics
from mlxkv.server.model_names import ModelNames
from mlxkv.server.model_registry import LoadLimits, ModelRegistry
from mlxkv.server.model_router import ModelRouter
from mlxkv.server.model_specs import NEVER, ModelSpec, unique, weights_estimate, with_keep_alive
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
# Several models: an idle one is unloaded after this (Ollama's default); one model never is.
DEFAULT_KEEP_ALIVE_S = 300.0
MIN_POOL_BYTES = 16 << 20  # a pool's least share of --memory-budget, whatever the weights take


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


@dataclass
class ModelsOptions:
    """How several models share the server (docs/server.md, "Several models")."""

    aliases: list[tuple[str, str]] = field(default_factory=list)  # (shell pattern, model name), in order
    default_model: str | None = None  # serves names that match nothing (one model: that one)
    max_loaded: int | None = None
    memory_budget: int | None = None  # bytes of weights plus pools
    keep_alive_s: float | None = None  # None: 5 minutes when several models are served, never for one

    def keep_alive(self, models: int) -> float:
        if self.keep_alive_s is not None:
            return self.keep_alive_s
        return DEFAULT_KEEP_ALIVE_S if models > 1 else NEVER


class Server:
    """Models served over HTTP until `close()`: `Server.load(model, cache)` for one,
    `Server.load_models(specs, cache)` for several (loaded on demand), or
    `Server(thread, name)` around one engine thread already started."""

    def __init__(self, thread: EngineThread | None, name: str | None = None, options: ServerOptions | None = None,
                 sock: socket.socket | None = None, *, specs: list[ModelSpec] | None = None,
                 cache: CacheConfig | None = None, models: ModelsOptions | None = None, load=load_engine):
        o = self.options = options or ServerOptions()
        self.socket = sock or bind(o.host, o.port)
        self.port = self.socket.getsockname()[1]
        self.cache, self._load, self.models = cache or CacheConfig(), load, models or ModelsOptions()
        self.metrics = ServerMetrics()
        # Every engine thread started, loaded or still loading: each is closed with the server.
        self._threads: set[EngineThread] = set() if thread is None else {thread}
        try:
            if specs is None:
                specs = [ModelSpec(short_name(name), name)]
            keep = self.models.keep_alive(len(specs))
            specs = unique([with_keep_alive(spec, keep) for spec in specs])
            default = self.models.default_model or (specs[0].name if len(specs) == 1 else None)
            self.names = ModelNames([spec.name for spec in specs], self.models.aliases, default)
            self.registry = ModelRegistry(specs, LoadLimits(self.models.max_loaded, self.models.memory_budget),
                                          estimate=self._estimate)
            self.router = ModelRouter(self.registry, self.names, self._start, self._stop)
            if thread is not None:
                self._adopt(self.registry.slot(specs[0].name), thread)
            elif len(specs) == 1:  # one model loads before serving, as it always has: a bad one fails at once
                self._adopt(self.registry.slot(specs[0].name), None)
        except BaseException:
            self._close_engine()
            raise
        app = build_app(self.router, self.metrics, AppConfig(o.api_key, o.max_body_bytes, o.temperature,
                                                             o.keepalive_s))
        config = uvicorn.Config(app, log_config=None, access_log=False,
                                timeout_graceful_shutdown=o.shutdown_grace_s + STOP_MARGIN_S)
        self.uvicorn = _Uvicorn(config, self._stopping)
        self._thread: threading.Thread | None = None

    @classmethod
    def load(cls, model: str, cache: CacheConfig, options: ServerOptions | None = None, *,
             load=load_engine, models: ModelsOptions | None = None) -> Server:
        """Bind first (a port in use fails at once), then load `model` on its engine thread."""
        return cls.load_models([ModelSpec(short_name(model), model)], cache, options, models, load=load)

    @classmethod
    def load_models(cls, specs: list[ModelSpec], cache: CacheConfig, options: ServerOptions | None = None,
                    models: ModelsOptions | None = None, *, load=load_engine) -> Server:
        """Bind first; one model loads now, several at their first requests."""
        options = options or ServerOptions()
        warn_if_exposed(options.host, options.api_key)
        sock = bind(options.host, options.port)
        return cls(None, options=options, sock=sock, specs=specs, cache=cache, models=models, load=load)

    # -- one model's engine, started and stopped (the router calls these on worker threads) ----

    def _adopt(self, slot, thread: EngineThread | None) -> None:
        begin = time.monotonic()
        self.registry.loading(slot)
        backend, footprint = self._start(slot.spec, thread)
        self.registry.loaded_as(slot, backend, footprint, time.monotonic() - begin)

    def _start(self, spec: ModelSpec, thread: EngineThread | None = None) -> tuple[ServingBackend, int]:
        if thread is None and encoder_family(checkpoint_config(spec.source)):
            return self._start_encoder(spec)
        if thread is None:
            thread = EngineThread(spec.source, self._cache_for(spec), load=self._load,
                                  on_event=_load_progress(spec.name))
            thread.start()
        self._threads.add(thread)
        o, slot = self.options, self.registry.slot(spec.name)
        try:
            backend = ServingBackend(thread, spec.source, max_open=o.max_open, default_max_tokens=o.max_tokens,
                                     reply_ids_kept=o.reply_ids_kept, reply_cap=o.reply_cap,
                                     image_limits=(o.max_image_pixels, o.max_images),
                                     allow_image_urls=o.allow_image_urls, display_name=spec.name,
                                     metrics=self.metrics, on_reply=lambda stats: self.registry.reply_done(slot, stats))
        except BaseException:
            self._stop_thread(thread)
            raise
        return backend, backend.info.nbytes

    def _start_encoder(self, spec: ModelSpec) -> tuple[EncoderBackend, int]:
        """An encoder embedding model (BERT, XLM-R, ModernBERT): its own thread, no pool."""
        thread = EncoderThread(spec.source).start()
        self._threads.add(thread)
        try:
            backend = EncoderBackend(thread, spec.name)
        except BaseException:
            self._stop_thread(thread)
            raise
        return backend, backend.info.nbytes

    def _stop(self, backend: ServingBackend) -> None:
        """Unload: the engine closes, and its cached blocks and checkpoints finish going to the tiers."""
        try:
            backend.close()
        finally:  # a close that fails must still end the engine thread: the budget counts it gone
            self._stop_thread(backend.thread)

    def _stop_thread(self, thread) -> None:
        thread.close()
        self._threads.discard(thread)

    def _cache_for(self, spec: ModelSpec) -> CacheConfig:
        budget = self.models.memory_budget is not None
        return model_cache(self.cache, spec, self._pool_bytes(spec) if budget else None)

    def _pool_bytes(self, spec: ModelSpec) -> int:
        """Under --memory-budget, a model's pool: its share of the budget less its weights."""
        count = len(self.registry.specs)
        share = self.models.memory_budget // max(1, min(count, self.models.max_loaded or count))
        return max(share - weights_estimate(spec.source), MIN_POOL_BYTES)

    def _estimate(self, spec: ModelSpec) -> int:
        """A model's bytes before its first load (afterwards the registry knows them)."""
        if self.models.memory_budget is None:
            return 0
        return weights_estimate(spec.source) + self._pool_bytes(spec)

    # -- the server ---------------------------------------------------------------------

    @property
    def backend(self) -> ServingBackend | None:
        """The first loaded model's backend (one model: its own)."""
        loaded = self.registry.loaded()
        return loaded[0].backend if loaded else None

    @property
    def engine(self) -> EngineThread | None:
        backend = self.backend
        return None if backend is None else backend.thread

    @property
    def url(self) -> str:
        host = self.options.host
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"

    def startup_line(self) -> str:
        if len(self.registry.names) == 1 and self.backend is not None:
            info = self.backend.info
            context = "" if info.max_context is None else f", context {info.max_context} tokens"
            return f"mlxkv serve: {self.url} (model {info.name}{context}; cache: {info.tiers})"
        lines = [f"mlxkv serve: {self.url} ({len(self.registry.names)} models, loaded on demand)"]
        for slot in self.registry.slots.values():
            pin = ", pinned" if slot.spec.pin else ""
            lines.append(f"  model {slot.name}: {slot.state} ({slot.spec.source}{pin})")
        return "\n".join(lines)

    def _stopping(self) -> None:
        """On the event loop, as uvicorn begins to stop: open replies end at the grace period's end."""
        loaded = self.registry.loaded()
        open_requests = sum(slot.backend.thread.open_requests for slot in loaded)
        if open_requests:
            log.info("stopping: %d open requests get %.0f s to finish", open_requests, self.options.shutdown_grace_s)
        for slot in loaded:
            slot.backend.stop_at = time.monotonic() + self.options.shutdown_grace_s

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
        """Every model's engine closes (the SSD tier's writes finish), a load still running too:
        its thread finishes loading, then closes with nothing written half."""
        router = getattr(self, "router", None)
        if router is not None:
            router.close()
        for thread in list(getattr(self, "_threads", ())):
            self._stop_thread(thread)
        self.socket.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def model_cache(cache: CacheConfig, spec: ModelSpec, pool_bytes: int | None = None) -> CacheConfig:
    """The server's cache flags with the model's own options (--models file) on top;
    `pool_bytes`: its pool's share of --memory-budget."""
    if spec.kv_format is not None:
        group = cache.engine_config().pool.kv_format.group_size  # the server's --kv-group-size
        cache = dataclasses.replace(cache, kv_format=dataclasses.replace(spec.kv_format, group_size=group),
                                    kv_bits=None, kv_group_size=DEFAULT_KV_GROUP_SIZE)
    if spec.speculative is not None:
        cache = dataclasses.replace(cache, speculative=spec.speculative, draft_model=spec.draft_model or cache.draft_model)
    if spec.context is not None:
        return dataclasses.replace(cache, num_blocks=-(-spec.context // cache.block_size))
    if pool_bytes is not None and cache.num_blocks is None:
        return dataclasses.replace(cache, memory_budget_bytes=pool_bytes)
    return dataclasses.replace(cache)


def _load_progress(name: str):
    """An engine thread's load progress, in the log (on the engine thread: it only logs)."""

    def on_event(event) -> None:
        if event.kind == "progress":
            log.info("model %s: %s%s", name, event.text,
                     "" if event.fraction is None else f" ({event.fraction:.0%})")

    return on_event


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
