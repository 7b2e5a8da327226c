"""OpenAI's Responses API (`POST /v1/responses`), as Codex and the `openai`
client's `responses.create` use it, over the shared reply stream.

A stream's events come in the documented order: response.created and
response.in_progress at once (before the prefill), then per output item
output_item.added, its content part or function-call arguments, their deltas
and done events, output_item.done, and response.completed (status
"incomplete" when max_output_tokens cut the reply; Codex treats the
response.incomplete event as a failure and retries, so a cut reply still
completes). A failure after the headers went out is response.failed.
Errors before it are OpenAI's error JSON.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse

from mlxkv.server.api_errors import ApiError
from mlxkv.server.http_support import Lenient, new_id, now, off_loop, parse_body, sse, until_disconnect
from mlxkv.server.image_parts import image_usage
from mlxkv.server.model_router import routed
from mlxkv.server.openai_api import KEEPALIVE_LINE, event_stream
from mlxkv.server.reply_stream import Reply
from mlxkv.server.responses_input import input_messages, template_tools
from mlxkv.server.structured_options import responses_grammar


class ResponsesRequest(Lenient):
    """Also sent and ignored: include, prompt_cache_key, metadata, client_metadata, reasoning."""

    model: str = ""
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    speculative: bool = True  # mlxkv's own: false decodes this reply without proposals
    text: Any = None  # its "format" (json_object / json_schema) is enforced (structured_options.py)
    grammar: Any = None  # mlxkv's own: Lark text or {"type", "value"} the reply must match


def usage(stats) -> dict:
    cached = sum(stats.cached_tokens.values())
    return {"input_tokens": stats.prompt_tokens, "input_tokens_details": {"cached_tokens": cached, **image_usage(stats)},
            "output_tokens": stats.generation_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": stats.prompt_tokens + stats.generation_tokens}


async def responses(request: Request):
    store = request.app.state.responses
    body = await parse_body(request, ResponsesRequest)
    system, new = input_messages(body.instructions, body.input)
    history: list[dict] = []
    if body.previous_response_id is not None:
        history = store.get(body.previous_response_id)
        if history is None:
            raise ApiError(400, f"no stored response {body.previous_response_id!r} (responses are kept in "
                                "memory, the newest first, when sent with store)", param="previous_response_id")
    tools = template_tools(body.tools, body.tool_choice)
    backend = await routed(request, body.model, body.stream)
    prompt = await off_loop(backend.chat_prompt, system + history + new, tools)
    tokens = prompt.tokens
    max_tokens = backend.reply_limit(tokens, body.max_output_tokens, param="input")
    temperature = request.app.state.temperature if body.temperature is None else body.temperature
    grammar = responses_grammar(body, backend.info.tokenizer)  # a 400 if it does not compile
    handle = backend.submit(tokens, max_tokens=max_tokens, temperature=temperature, top_p=body.top_p or 0.0,
                            speculative=body.speculative, head=prompt.head,
                            **({} if grammar is None else {"grammar": grammar}))
    reply = request.state.reply = Reply(backend, handle, tokens, None, tools)
    shape = _Shape(body, backend.info.name)
    kept = (lambda message: store.put(shape.id, history + new + [message])) if body.store else (lambda m: None)
    if body.stream:
        return event_stream(_events(shape, reply, request.app.state.keepalive, kept))
    whole = await until_disconnect(request, reply.collect())
    items = ([_message(new_id("msg_"), whole.text)] if whole.text or not whole.tool_calls else [])
    items += [_call_item(c) for c in whole.tool_calls]
    kept(_as_message(whole.text, whole.tool_calls))
    return JSONResponse(shape.response("completed", items, whole.finish_reason, whole.stats))


class _Shape:
    """The response object's fields that every event repeats."""

    def __init__(self, body: ResponsesRequest, model: str):
        self.id, self.created, self.body, self.model = new_id("resp_"), now(), body, model

    def response(self, status: str, output: list[dict], finish: str | None = None, stats=None,
                 error: dict | None = None) -> dict:
        b = self.body
        cut = finish == "length"
        return {"id": self.id, "object": "response", "created_at": self.created, "model": self.model,
                "status": "incomplete" if status == "completed" and cut else status,
                "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "error": error,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "output": output,
                "parallel_tool_calls": b.parallel_tool_calls is not False, "previous_response_id":
                b.previous_response_id, "store": b.store, "temperature": b.temperature, "top_p": b.top_p,
                "tool_choice": b.tool_choice or "auto", "tools": b.tools or [],
                "text": b.text or {"format": {"type": "text"}},
                "truncation": "disabled", "metadata": {}, "usage": None if stats is None else usage(stats)}


def _message(item_id: str, text: str, status: str = "completed") -> dict:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _call_item(call, status: str = "completed", arguments: str | None = None) -> dict:
    return {"type": "function_call", "id": f"fc_{call.id}", "call_id": call.id, "name": call.name,
            "arguments": call.arguments if arguments is None else arguments, "status": status}


def _as_message(text: str, calls) -> dict:
    """The reply as a chat message, for a follow-up's previous_response_id."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.input()}} for c in calls]
    return message


async def _events(shape: _Shape, reply: Reply, keepalive: float, kept):
    stream = _EventWriter()
    yield stream.event("response.created", response=shape.response("in_progress", []))
    yield stream.event("response.in_progress", response=shape.response("in_progress", []))
    text, calls = [], []
    try:
        async for event in reply.events(keepalive):
            if event.waiting:
                yield KEEPALIVE_LINE
            if event.text:
                text.append(event.text)
                for line in stream.text(event.text):
                    yield line
            for call in event.tool_calls:
                calls.append(call)
                for line in stream.call(call):
                    yield line
            if event.finish_reason is not None:
                for line in stream.close_message(final=True):
                    yield line
                kept(_as_message("".join(text), calls))
                yield stream.event("response.completed", response=shape.response(
                    "completed", stream.items, event.finish_reason, event.stats))
    except ApiError as e:
        error = {"code": "server_error", "message": e.message}
        yield stream.event("response.failed", response=shape.response("failed", stream.items, error=error))


class _EventWriter:
    """Events with their sequence numbers; output items as they open and close."""

    def __init__(self):
        self.sequence = 0
        self.items: list[dict] = []  # done items, in output order
        self._message: list[str] | None = None  # the open message's text
        self._message_id = ""

    def event(self, kind: str, **fields) -> str:
        self.sequence += 1
        return sse({"type": kind, "sequence_number": self.sequence - 1, **fields}, kind)

    def text(self, delta: str):
        where = {"output_index": len(self.items), "content_index": 0}
        if self._message is None:
            self._message, self._message_id = [], new_id("msg_")
            yield self.event("response.output_item.added", output_index=len(self.items),
                             item=_message(self._message_id, "", "in_progress"))
            yield self.event("response.content_part.added", item_id=self._message_id, **where,
                             part={"type": "output_text", "text": "", "annotations": []})
        self._message.append(delta)
        yield self.event("response.output_text.delta", item_id=self._message_id, **where, delta=delta, logprobs=[])

    def close_message(self, final: bool = False):
        if self._message is None:
            if not (final and not self.items):
                return
            yield from self.text("")  # a reply with no output still has its (empty) message
        text, item_id = "".join(self._message), self._message_id
        where = {"item_id": item_id, "output_index": len(self.items), "content_index": 0}
        yield self.event("response.output_text.done", **where, text=text, logprobs=[])
        yield self.event("response.content_part.done", **where,
                         part={"type": "output_text", "text": text, "annotations": []})
        item = _message(item_id, text)
        yield self.event("response.output_item.done", output_index=len(self.items), item=item)
        self.items.append(item)
        self._message = None

    def call(self, call):
        yield from self.close_message()
        index, item_id = len(self.items), f"fc_{call.id}"
        yield self.event("response.output_item.added", output_index=index,
                         item=_call_item(call, "in_progress", ""))
        yield self.event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                         delta=call.arguments)
        yield self.event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                         name=call.name, arguments=call.arguments)
        item = _call_item(call)
        yield self.event("response.output_item.done", output_index=index, item=item)
        self.items.append(item)
