"""The HTTP application: routes, the API key, errors in each API's shape, metrics.

Starlette rather than FastAPI: the two APIs want their own error JSON and
their own validation messages, SSE is a few lines, and the request models
are plain pydantic, so FastAPI's dependency injection and generated schema
would be bypassed more than used.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from mlxkv.server import anthropic_api, embeddings_api, openai_api, responses_api
from mlxkv.server.api_errors import ApiError, is_anthropic_path
from mlxkv.server.loading_stream import LoadPending, loading_stream
from mlxkv.server.model_registry import LOADED
from mlxkv.server.model_stats import model_lines, model_stats
from mlxkv.server.response_store import ResponseStore
from mlxkv.server.http_support import DEFAULT_MAX_BODY_BYTES, ClientGone

log = logging.getLogger(__name__)
access_log = logging.getLogger("mlxkv.server.access")

# A stream waiting for its first token (a long prefill) sends a keep-alive this often.
KEEPALIVE_S = 3.0
# The status logged and counted for a client that hung up first (nginx's "client closed request").
CLIENT_GONE = 499


@dataclass
class AppConfig:
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    temperature: float = 0.0  # when a request does not say
    keepalive_s: float = KEEPALIVE_S


def error_response(path: str, error: ApiError) -> JSONResponse:
    body = error.anthropic_body() if is_anthropic_path(path) else error.openai_body()
    return JSONResponse(body, status_code=error.status, headers=error.headers)


def endpoint(fn: Callable[[Request], Awaitable[Response]]):
    """An endpoint whose errors are its API's JSON (a bug's traceback goes to
    the log), counted in /metrics by endpoint and status."""

    async def run(request: Request) -> Response:
        try:
            response = await fn(request)
        except LoadPending as pending:  # a stream whose model loads first: it opens now
            response = loading_stream(request, fn, pending.task)
        except ApiError as e:
            request.state.error = e.message  # for the access log
            response = error_response(request.url.path, e)
        except ClientGone:
            response = Response(status_code=CLIENT_GONE)
        except Exception as e:
            log.exception("%s %s failed", request.method, request.url.path)
            response = error_response(request.url.path, ApiError(500, f"internal error: {type(e).__name__}: {e}"))
        request.app.state.metrics.request_done(request.url.path, response.status_code)
        return response

    return run


class ApiKey:
    """ASGI middleware: every request must carry the key, as a bearer token
    (OpenAI's clients) or in x-api-key (Anthropic's), or gets a 401."""

    def __init__(self, app, key: str | None):
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.key is None or self._allowed(scope):
            return await self.app(scope, receive, send)
        error = ApiError(401, "missing or wrong API key (send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY')")
        await error_response(scope["path"], error)(scope, receive, send)

    def _allowed(self, scope) -> bool:
        headers = dict(scope["headers"])
        given = headers.get(b"x-api-key", b"").decode("latin-1")
        auth = headers.get(b"authorization", b"").decode("latin-1")
        if auth[:7].lower() == "bearer ":
            given = given or auth[7:].strip()
        return hmac.compare_digest(given.encode(), self.key.encode())


class ModelLeases:
    """ASGI middleware: a request's model (model_router.routed) is released once its
    response has been sent, a stream's last event too, or the request failed."""

    def __init__(self, app, router):
        self.app, self.router = app, router

    async def __call__(self, scope, receive, send):
        try:
            await self.app(scope, receive, send)
        finally:
            slot = scope.get("state", {}).get("model_slot")
            if slot is not None:
                self.router.release(slot)


def _keep_alive(router):
    """The lifespan: idle models are unloaded while the server runs."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        task = asyncio.get_running_loop().create_task(router.reap_forever())
        try:
            yield
        finally:
            task.cancel()

    return lifespan


class AccessLog:
    """ASGI middleware: one line per request once its response has ended
    (a stream's too): method, path, status, prompt and cached tokens, TTFT,
    tokens out, duration."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        begin, status = time.perf_counter(), [CLIENT_GONE]

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            state = scope.get("state", {})
            error = f" ({state['error']})" if "error" in state else ""
            access_log.info("%s %s %d%s %.2fs%s", scope["method"], scope["path"], status[0],
                            _reply_fields(state.get("reply")), time.perf_counter() - begin, error)


def _reply_fields(reply) -> str:
    if reply is None:
        return ""
    if reply.stats is None:
        return f" prompt={reply.prompt_len} cancelled" if reply.cancelled else f" prompt={reply.prompt_len}"
    s = reply.stats
    cached = sum(s.cached_tokens.values())
    # restore: what was chosen for a prefix hit in a tier (cache/restore_cost.py), when there was one.
    restore = f" restore={s.restore} recomputed={s.recomputed_hit_tokens}" if s.restore else ""
    return (f" prompt={s.prompt_tokens} cached={cached}{_tier_fields(s.cached_tokens)}"
            f"{_image_fields(s)} ttft={s.ttft_s:.2f}s out={s.generation_tokens}{restore}")


# How the access log names the tiers a prompt's reuse came from beyond the pool.
TIER_WORDS = {"memory": "memory", "disk": "SSD", "remote": "remote"}


def _tier_fields(cached_tokens: dict) -> str:
    """" (40 from SSD)": the cached tokens that came from a tier, not the pool (after a restart or reload)."""
    parts = [f"{n} from {TIER_WORDS.get(tier, tier)}" for tier, n in cached_tokens.items() if tier != "pool" and n]
    return f" ({', '.join(parts)})" if parts else ""


def _image_fields(stats) -> str:
    """A prompt with images: its image tokens, and how many of them came from the cache (the
    request's own counts, as its usage reports them)."""
    if not stats.image_tokens:
        return ""
    return f" image_tokens={stats.image_tokens} image_cached={stats.cached_image_tokens}"


async def root(request: Request) -> Response:
    """Clients probe the base URL (Claude Code sends HEAD / first)."""
    return PlainTextResponse(f"mlxkv serve: {', '.join(request.app.state.models.registry.names)}\n")


async def health(request: Request) -> Response:
    """ok while every loaded model's engine thread runs; 503 once one has stopped, or a
    distributed set lost a rank (with why)."""
    registry = request.app.state.models.registry
    loaded = registry.loaded()
    lost = [reason for slot in loaded if (reason := slot.backend.stats().get("distributed", {}).get("lost"))]
    ok = all(slot.backend.thread.alive for slot in loaded) and not lost
    body = {"status": "ok" if ok else "engine stopped", **({"reason": lost[0]} if lost else {})}
    if len(registry.names) == 1:
        body["model"] = registry.names[0]
    else:
        body["models"] = {name: slot.state for name, slot in registry.slots.items()}
    return JSONResponse(body, status_code=200 if ok else 503)


def _model_card(slot, created: int) -> dict:
    info = None if slot.backend is None else slot.backend.info
    return {"id": slot.name, "object": "model", "created": getattr(slot.backend, "created", created),
            "owned_by": "mlxkv", "context_length": None if info is None else info.max_context,
            "loaded": slot.state == LOADED, "state": slot.state}


async def models(request: Request) -> Response:
    registry, created = request.app.state.models.registry, request.app.state.created
    return JSONResponse({"object": "list", "data": [_model_card(s, created) for s in registry.slots.values()]})


async def model(request: Request) -> Response:
    router = request.app.state.models
    wanted = request.path_params["model_id"]
    if wanted not in router.registry.slots:
        raise ApiError(404, router.names.unknown(wanted), param="model")
    return JSONResponse(_model_card(router.registry.slot(wanted), request.app.state.created))


async def cache_stats(request: Request) -> Response:
    """One model: its engine's stats, as before, and "models"; several: "models" alone."""
    registry = request.app.state.models.registry
    per_model = {name: model_stats(registry, slot) for name, slot in registry.slots.items()}
    if len(per_model) == 1:
        slot = next(iter(registry.slots.values()))
        return JSONResponse({**(slot.backend.stats() if slot.backend is not None else {}), "models": per_model})
    return JSONResponse({"models": per_model})


async def metrics(request: Request) -> Response:
    registry = request.app.state.models.registry
    loaded = registry.loaded()
    one = loaded[0] if len(registry.names) == 1 and loaded else None
    stats = one.backend.stats() if one is not None else {}  # as the engine thread last published it
    open_requests = sum(s.backend.thread.open_requests for s in loaded)
    text = request.app.state.metrics.render(open_requests, stats.get("pool"), stats.get("speculative"),
                                            tiers=stats.get("connector"), structured=stats.get("structured"),
                                            encoder=stats.get("encoder_cache"), distributed=stats.get("distributed"))
    rows = {name: model_stats(registry, slot) for name, slot in registry.slots.items()}
    return PlainTextResponse(text + "\n".join(model_lines(rows)) + "\n", media_type="text/plain; version=0.0.4")


async def _http_error(request: Request, exc: HTTPException) -> Response:
    message = {404: f"no such endpoint: {request.method} {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
    return error_response(request.url.path, ApiError(exc.status_code, message))


def build_app(router, counters, config: AppConfig | None = None) -> Starlette:
    """`router`: a ModelRouter over the served models; `counters`: the server's ServerMetrics."""
    config = config or AppConfig()
    routes = [
        Route("/", endpoint(root), methods=["GET", "HEAD"]),
        Route("/health", endpoint(health)),
        Route("/metrics", endpoint(metrics)),
        Route("/v1/models", endpoint(models)),
        Route("/v1/models/{model_id:path}", endpoint(model)),
        Route("/v1/cache/stats", endpoint(cache_stats)),
        Route("/v1/chat/completions", endpoint(openai_api.chat_completions), methods=["POST"]),
        Route("/v1/completions", endpoint(openai_api.completions), methods=["POST"]),
        Route("/v1/embeddings", endpoint(embeddings_api.embeddings), methods=["POST"]),
        Route("/v1/responses", endpoint(responses_api.responses), methods=["POST"]),
        Route("/v1/messages", endpoint(anthropic_api.messages), methods=["POST"]),
        Route("/v1/messages/count_tokens", endpoint(anthropic_api.count_tokens), methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error}, lifespan=_keep_alive(router))
    app.state.models = router
    app.state.metrics = counters
    app.state.created = int(time.time())
    app.state.max_body_bytes = config.max_body_bytes
    app.state.temperature = config.temperature
    app.state.keepalive = config.keepalive_s
    app.state.responses = ResponseStore()
    app.add_middleware(ApiKey, key=config.api_key)
    app.add_middleware(AccessLog)
    app.add_middleware(ModelLeases, router=router)  # outermost: the access line is not held up by a release
    return app
