"""OpenAI's chat completions and completions, over the shared reply stream.

Shapes follow the official API: usage carries
`prompt_tokens_details.cached_tokens`; streams are SSE chunks ending in
`data: [DONE]`, with a usage chunk when `stream_options.include_usage`.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from mlxkv.server.api_errors import ApiError
from mlxkv.server.image_parts import image_from_url, image_usage
from mlxkv.server.model_router import routed
from mlxkv.server.http_support import SSE_HEADERS, Lenient, new_id, now, off_loop, parse_body, sse, until_disconnect
from mlxkv.server.reply_stream import Reply, WholeReply
from mlxkv.server.structured_options import chat_grammar

Role = Literal["system", "developer", "user", "assistant", "tool"]


class ContentPart(Lenient):
    type: str
    text: str | None = None
    image_url: Any = None  # {"url": "data:..."} (server/image_parts.py)


class ChatMessage(Lenient):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class StreamOptions(Lenient):
    include_usage: bool = False


class _Sampling(Lenient):
    model: str = ""
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, ge=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    speculative: bool = True  # mlxkv's own: false decodes this reply without proposals
    grammar: Any = None  # mlxkv's own: Lark text or {"type", "value"} the reply must match (structured_options.py)

    def options(self, default_temperature: float) -> dict:
        temperature = default_temperature if self.temperature is None else self.temperature
        return dict(temperature=temperature, top_p=self.top_p or 0.0, seed=self.seed, speculative=self.speculative)

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # None: true, OpenAI's default
    response_format: Any = None


class CompletionRequest(_Sampling):
    prompt: str | list[int]


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """Messages as chat templates take them: text content, a developer as the system."""
    out = []
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": _text(m.content, i)}
        if m.tool_calls:
            msg["tool_calls"] = [_template_call(c) for c in m.tool_calls]
        for key in ("name", "tool_call_id"):
            if getattr(m, key) is not None:
                msg[key] = getattr(m, key)
        out.append(msg)
    return out


def _text(content, index: int) -> str | list[dict]:
    if content is None or isinstance(content, str):
        return content or ""
    where = f"messages.{index}.content"
    for j, part in enumerate(content):  # every part checked first: none is dropped beside an image
        if part.type not in ("text", "image_url") or (part.type == "text" and part.text is None):
            raise ApiError(400, f"{where}.{j}: {part.type!r} parts are not supported (text and image_url are)",
                           param=where)
    if any(part.type == "image_url" for part in content):  # text and images, in order
        return [image_from_url(p.image_url, f"{where}.{j}", where)
                if p.type == "image_url" else {"type": "text", "text": p.text} for j, p in enumerate(content)]
    return "".join(part.text for part in content)


def _template_call(call: dict) -> dict:
    """A tool call as templates render it: arguments as an object (they apply tojson)."""
    function = dict(call.get("function") or {})
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            function["arguments"] = json.loads(args)
        except json.JSONDecodeError:
            pass
    return {**call, "function": function}


def usage(stats) -> dict:
    cached = sum(stats.cached_tokens.values())
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generation_tokens,
        "total_tokens": stats.prompt_tokens + stats.generation_tokens,
        "prompt_tokens_details": {"cached_tokens": cached, **image_usage(stats)},
    }


async def chat_completions(request: Request):
    body = await parse_body(request, ChatRequest)
    backend = await routed(request, body.model, body.stream)
    tools = body.tools or None
    if body.tool_choice == "none":
        tools = None
    prompt = await off_loop(backend.chat_prompt, template_messages(body.messages), tools)
    reply = start(request, prompt.tokens, body.max_completion_tokens or body.max_tokens, body, tools, "messages",
                  head=prompt.head)
    if body.stream:
        return event_stream(_chat_chunks(backend.info.name, reply, body, request.app.state.keepalive))
    whole = await until_disconnect(request, reply.collect())
    message: dict[str, Any] = {"role": "assistant", "content": whole.text}
    if whole.tool_calls:
        message["tool_calls"] = [c.as_openai() for c in whole.tool_calls]
    choice = {"index": 0, "message": message, "finish_reason": _finish(whole), "logprobs": None}
    return JSONResponse({"id": new_id("chatcmpl-"), "object": "chat.completion", "created": now(),
                         "model": backend.info.name, "choices": [choice], "usage": usage(whole.stats)})


async def completions(request: Request):
    body = await parse_body(request, CompletionRequest)
    backend = await routed(request, body.model, body.stream)
    if isinstance(body.prompt, str):
        tokens = await off_loop(backend.text_tokens, body.prompt)
    else:
        tokens = backend.token_ids(body.prompt)
    reply = start(request, tokens, body.max_tokens, body, None, "prompt")
    if body.stream:
        return event_stream(_completion_chunks(backend.info.name, reply, body, request.app.state.keepalive))
    whole = await until_disconnect(request, reply.collect())
    choice = {"index": 0, "text": whole.text, "finish_reason": _finish(whole), "logprobs": None}
    return JSONResponse({"id": new_id("cmpl-"), "object": "text_completion", "created": now(),
                         "model": backend.info.name, "choices": [choice], "usage": usage(whole.stats)})


def start(request: Request, tokens: list[int], max_tokens: int | None, body: _Sampling,
          tools: list | None, param: str, head: int = 0) -> Reply:
    """Queue the request (max_tokens cut to the room left) and start reading its reply;
    `head`: where its system-and-tools head ends (backend.ChatPrompt)."""
    backend = request.state.backend
    max_tokens = backend.reply_limit(tokens, max_tokens, param=param)
    grammar = chat_grammar(body, backend.info.tokenizer)  # a 400 if it does not compile
    handle = backend.submit(tokens, max_tokens=max_tokens, head=head, **body.options(request.app.state.temperature),
                            **({} if grammar is None else {"grammar": grammar}))
    reply = request.state.reply = Reply(backend, handle, tokens, body.stops(), tools)
    return reply


def _finish(whole: WholeReply | Any) -> str:
    return "stop" if whole.finish_reason == "stop_sequence" else whole.finish_reason


def event_stream(events) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)


# An SSE comment: clients skip it, and it keeps proxies and idle timers from closing the stream.
KEEPALIVE_LINE = ": keep-alive\n\n"


async def _chat_chunks(model: str, reply: Reply, body: ChatRequest, keepalive: float):
    head = {"id": new_id("chatcmpl-"), "object": "chat.completion.chunk", "created": now(), "model": model}

    def chunk(delta: dict, finish: str | None = None, **error) -> str:
        return sse({**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
                    **error})

    yield chunk({"role": "assistant", "content": ""})
    calls = 0
    async for event in _events_or_error(reply, keepalive, lambda error: chunk({}, "length", **error)):
        if isinstance(event, str):
            yield event
            continue
        if event.text:
            yield chunk({"content": event.text})
        for call in event.tool_calls:
            yield chunk({"tool_calls": [call.as_openai(index=calls)]})
            calls += 1
        if event.finish_reason is not None:
            yield chunk({}, _finish(event))
            if body.stream_options is not None and body.stream_options.include_usage:
                yield sse({**head, "choices": [], "usage": usage(event.stats)})
    yield sse("[DONE]")


async def _completion_chunks(model: str, reply: Reply, body: CompletionRequest, keepalive: float):
    head = {"id": new_id("cmpl-"), "object": "text_completion", "created": now(), "model": model}

    def failed(error: dict) -> str:
        return sse({**head, "choices": [{"index": 0, "text": "", "finish_reason": "length", "logprobs": None}],
                    **error})

    async for event in _events_or_error(reply, keepalive, failed):
        if isinstance(event, str):
            yield event
            continue
        finish = None if event.finish_reason is None else _finish(event)
        yield sse({**head, "choices": [{"index": 0, "text": event.text, "finish_reason": finish, "logprobs": None}]})
        if finish is not None and body.stream_options is not None and body.stream_options.include_usage:
            yield sse({**head, "choices": [], "usage": usage(event.stats)})
    yield sse("[DONE]")


async def _events_or_error(reply: Reply, keepalive: float, failed):
    """The reply's events, keep-alive lines while it waits, and on a failure
    after the headers went out (or a stop cutting the reply) `failed(error)`:
    a last chunk with a finish reason and the error, as OpenAI sends one, then [DONE]."""
    try:
        async for event in reply.events(keepalive):
            yield KEEPALIVE_LINE if event.waiting else event
    except ApiError as e:
        yield failed(e.openai_body())
