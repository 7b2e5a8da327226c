"""The HTTP application: routes, the API key, errors in each API's shape, metrics.

Starlette rather than FastAPI: the two APIs want their own error JSON and
their own validation messages, SSE is a few lines, and the request models
are plain pydantic, so FastAPI's dependency injection and generated schema
would be bypassed more than used.
"""

from __future__ import annotations

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

from mlxkv.server import anthropic_api, openai_api, responses_api
from mlxkv.server.api_errors import ApiError, is_anthropic_path
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
        except ApiError as e:
            request.state.error = e.message  # for the access log
            response = error_response(request.url.path, e)
        except ClientGone:
            response = Response(status_code=CLIENT_GONE)
        except Exception as e:
            log.exception("%s %s failed", request.method, request.url.path)
            response = error_response(request.url.path, ApiError(500, f"internal error: {type(e).__name__}: {e}"))
        request.app.state.backend.request_done(request.url.path, response.status_code)
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
    return (f" prompt={s.prompt_tokens} cached={cached}{_image_fields(reply.prompt, cached)} ttft={s.ttft_s:.2f}s "
            f"out={s.generation_tokens}{restore}")


def _image_fields(prompt, cached: int) -> str:
    """A prompt with images: its image tokens, and how many of them came from the cache (vision/prompt.py)."""
    if not getattr(prompt, "spans", None):
        return ""
    return f" image_tokens={prompt.image_tokens} image_cached={prompt.cached_image_tokens(cached)}"


async def root(request: Request) -> Response:
    """Clients probe the base URL (Claude Code sends HEAD / first)."""
    return PlainTextResponse(f"mlxkv serve: {request.app.state.backend.info.name}\n")


async def health(request: Request) -> Response:
    backend = request.app.state.backend
    ok = backend.thread.alive
    return JSONResponse({"status": "ok" if ok else "engine stopped", "model": backend.info.name},
                        status_code=200 if ok else 503)


def _model_card(backend) -> dict:
    info = backend.info
    return {"id": info.name, "object": "model", "created": backend.created, "owned_by": "mlxkv",
            "context_length": info.max_context}


async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(request.app.state.backend)]})


async def model(request: Request) -> Response:
    backend = request.app.state.backend
    wanted = request.path_params["model_id"]
    if wanted != backend.info.name:
        raise ApiError(404, f"no model {wanted!r} here; this server has {backend.info.name!r} "
                            "(and answers requests for any model name with it)", param="model")
    return JSONResponse(_model_card(backend))


async def cache_stats(request: Request) -> Response:
    return JSONResponse(request.app.state.backend.stats())


async def metrics(request: Request) -> Response:
    backend = request.app.state.backend
    stats = backend.stats()  # as the engine thread last published it
    text = backend.metrics.render(backend.thread.open_requests, stats.get("pool"), stats.get("speculative"),
                                  tiers=stats.get("connector"), structured=stats.get("structured"),
                                  encoder=stats.get("encoder_cache"))
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


async def _http_error(request: Request, exc: HTTPException) -> Response:
    message = {404: f"no such endpoint: {request.method} {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
    return error_response(request.url.path, ApiError(exc.status_code, message))


def build_app(backend, config: AppConfig | None = None) -> Starlette:
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
        Route("/v1/responses", endpoint(responses_api.responses), methods=["POST"]),
        Route("/v1/messages", endpoint(anthropic_api.messages), methods=["POST"]),
        Route("/v1/messages/count_tokens", endpoint(anthropic_api.count_tokens), methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    app.state.backend = backend
    app.state.max_body_bytes = config.max_body_bytes
    app.state.temperature = config.temperature
    app.state.keepalive = config.keepalive_s
    app.state.responses = ResponseStore()
    app.add_middleware(ApiKey, key=config.api_key)
    app.add_middleware(AccessLog)
    return app
