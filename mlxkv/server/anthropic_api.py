"""Anthropic's Messages API over the shared reply stream.

`usage.input_tokens` counts the prompt tokens computed, and
`cache_read_input_tokens` those reused (as the API splits them). A stream's
events come in the documented order: message_start, then per content block
start / deltas / stop, then message_delta (stop reason and usage) and
message_stop.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from mlxkv.server.api_errors import ApiError
from mlxkv.server.image_parts import image_from_source, image_usage
from mlxkv.server.model_router import routed
from mlxkv.server.http_support import SSE_HEADERS, Lenient, new_id, off_loop, parse_body, sse, until_disconnect
from mlxkv.server.prompt_heads import strip_head_blocks
from mlxkv.server.reply_stream import Reply
from mlxkv.server.structured_options import anthropic_grammar

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "stop_sequence": "stop_sequence"}


class Block(Lenient):
    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    source: Any = None  # an image block's (server/image_parts.py)


Block.model_rebuild()


class Message(Lenient):
    # Claude Code 2.1 sends a "system" message among the others (its
    # attribution reminder); it is rendered where it stands.
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class Tool(Lenient):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=dict)
    strict: bool | None = None  # its input enforced under tool_choice auto too (structured_options.py)


class CountRequest(Lenient):
    model: str = ""
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[Tool] | None = None
    tool_choice: dict[str, Any] | None = None


class MessagesRequest(CountRequest):
    max_tokens: int = Field(ge=1)
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool = False
    speculative: bool = True  # mlxkv's own: false decodes this reply without proposals
    output_config: Any = None  # its "format" (json_schema): the reply's text is enforced (structured_options.py)
    output_format: Any = None  # the same format as the structured-outputs beta sent it
    grammar: Any = None  # mlxkv's own: Lark text or {"type", "value"} the reply must match


def template_messages(body: CountRequest) -> list[dict]:
    """The conversation as chat templates take it: tool_use blocks become
    tool_calls, tool_result blocks become "tool" messages."""
    out: list[dict] = []
    system = body.system
    if isinstance(system, list):  # a per-request block at the head goes (prompt_heads.py)
        system = strip_head_blocks(_texts(system, "system"))
    if system:
        out.append({"role": "system", "content": _text(system, "system")})
    for i, m in enumerate(body.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts, calls, parts = [], [], []  # parts: text and images in order, when there are images
        for j, block in enumerate(m.content):
            where = f"messages.{i}.content.{j}"
            if block.type == "text":
                texts.append(block.text or "")
                parts.append({"type": "text", "text": block.text or ""})
            elif block.type == "image" and m.role == "user":
                parts.append(image_from_source(block.source, where))
            elif block.type == "tool_use" and m.role == "assistant":
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": block.input or {}}})
            elif block.type == "tool_result" and m.role == "user":
                out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": _tool_result(block.content or "", where)})
            elif block.type in ("thinking", "redacted_thinking"):
                continue  # the model never sees earlier thinking again
            else:
                raise ApiError(400, f"{where}: {block.type!r} blocks are not supported in {m.role} messages")
        if len(parts) > len(texts):
            out.append({"role": m.role, "content": parts})
        elif texts or calls:
            msg: dict[str, Any] = {"role": m.role, "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def _tool_result(content, where: str) -> str | list[dict]:
    """A tool_result's content; with image blocks (an agent's screenshot, an image file it read), text
    and images in order, as OpenAI's tool messages carry image_url parts."""
    if isinstance(content, str) or not any(b.type == "image" for b in content):
        return _text(content, where)
    return [image_from_source(b.source, f"{where}.content.{k}") if b.type == "image"
            else {"type": "text", "text": _text([b], f"{where}.content.{k}")} for k, b in enumerate(content)]


def _text(content, where: str) -> str:
    return content if isinstance(content, str) else "".join(_texts(content, where))


def _texts(blocks: list[Block] | list[str], where: str) -> list[str]:
    for block in blocks:
        if not isinstance(block, str) and block.type != "text":
            raise ApiError(400, f"{where}: only text blocks are supported here, got {block.type!r}")
    return [block if isinstance(block, str) else block.text or "" for block in blocks]


def template_tools(tools: list[Tool] | None, choice: dict | None) -> list[dict] | None:
    if not tools or (choice or {}).get("type") == "none":
        return None
    return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                              "parameters": t.input_schema}} for t in tools]


def usage(stats) -> dict:
    cached = sum(stats.cached_tokens.values())
    return {"input_tokens": stats.prompt_tokens - cached, "output_tokens": stats.generation_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0, **image_usage(stats)}


async def count_tokens(request: Request):
    body = await parse_body(request, CountRequest)
    backend = await routed(request, body.model)
    tokens = await off_loop(backend.chat_tokens, template_messages(body), template_tools(body.tools, body.tool_choice))
    return JSONResponse({"input_tokens": len(tokens)})


async def messages(request: Request):
    body = await parse_body(request, MessagesRequest)
    backend = await routed(request, body.model, body.stream)
    tools = template_tools(body.tools, body.tool_choice)
    prompt = await off_loop(backend.chat_prompt, template_messages(body), tools)
    tokens = prompt.tokens
    max_tokens = backend.reply_limit(tokens, body.max_tokens, anthropic=True)
    temperature = request.app.state.temperature if body.temperature is None else body.temperature
    grammar = anthropic_grammar(body, backend.info.tokenizer)  # a 400 if it does not compile
    handle = backend.submit(tokens, max_tokens=max_tokens, temperature=temperature, top_p=body.top_p or 0.0,
                            top_k=body.top_k or 0, speculative=body.speculative, head=prompt.head,
                            **({} if grammar is None else {"grammar": grammar}))
    reply = request.state.reply = Reply(backend, handle, tokens, body.stop_sequences, tools)
    head = {"id": new_id("msg_"), "type": "message", "role": "assistant", "model": backend.info.name}
    if body.stream:
        return StreamingResponse(_events(head, reply, len(tokens), request.app.state.keepalive),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    whole = await until_disconnect(request, reply.collect())
    content = [{"type": "text", "text": whole.text}] if whole.text or not whole.tool_calls else []
    content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.input()} for c in whole.tool_calls]
    return JSONResponse({**head, "content": content, "stop_reason": STOP_REASONS[whole.finish_reason],
                         "stop_sequence": whole.stop_sequence, "usage": usage(whole.stats)})


PING = sse({"type": "ping"}, "ping")


async def _events(head: dict, reply: Reply, prompt_len: int, keepalive: float):
    """message_start at once (before the prefill), pings while it runs, then the message."""
    start_usage = {"input_tokens": prompt_len, "output_tokens": 0}
    yield sse({"type": "message_start", "message": {**head, "content": [], "stop_reason": None,
                                                    "stop_sequence": None, "usage": start_usage}}, "message_start")
    blocks = _Blocks()
    try:
        async for event in reply.events(keepalive):
            if event.waiting:
                yield PING
            if event.text:
                for line in blocks.text(event.text):
                    yield line
            for call in event.tool_calls:
                for line in blocks.tool_use(call):
                    yield line
            if event.finish_reason is not None:
                for line in blocks.close(final=True):
                    yield line
                delta = {"stop_reason": STOP_REASONS[event.finish_reason], "stop_sequence": event.stop_sequence}
                yield sse({"type": "message_delta", "delta": delta, "usage": usage(event.stats)}, "message_delta")
                yield sse({"type": "message_stop"}, "message_stop")
    except ApiError as e:
        yield sse(e.anthropic_body(), "error")


class _Blocks:
    """Content blocks of a streamed message: a text block stays open until a tool call or the end."""

    def __init__(self):
        self.index = -1
        self.open_kind: str | None = None

    def text(self, text: str):
        if self.open_kind != "text":
            yield from self.close()
            yield from self._start({"type": "text", "text": ""}, "text")
        yield sse({"type": "content_block_delta", "index": self.index,
                   "delta": {"type": "text_delta", "text": text}}, "content_block_delta")

    def tool_use(self, call):
        yield from self.close()
        yield from self._start({"type": "tool_use", "id": call.id, "name": call.name, "input": {}}, "tool_use")
        yield sse({"type": "content_block_delta", "index": self.index,
                   "delta": {"type": "input_json_delta", "partial_json": json.dumps(call.input())}},
                  "content_block_delta")
        yield from self.close()

    def close(self, final: bool = False):
        if final and self.index < 0:  # a message has at least one block
            yield from self._start({"type": "text", "text": ""}, "text")
        if self.open_kind is not None:
            yield sse({"type": "content_block_stop", "index": self.index}, "content_block_stop")
            self.open_kind = None

    def _start(self, block: dict, kind: str):
        self.index += 1
        self.open_kind = kind
        yield sse({"type": "content_block_start", "index": self.index, "content_block": block}, "content_block_start")
