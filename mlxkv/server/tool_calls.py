"""Tool calls in a streamed reply, parsed through mlx-lm's tool parsers.

mlx-lm's tokenizer wrapper names, for models that call tools, the strings
that open and close a call (`tool_call_start`, `tool_call_end`) and a parser
for the text between them (`tool_parser(text, tools)`: a dict, or a list of
dicts, with "name" and "arguments"). A `ToolCallSplitter` takes the reply's
text deltas and separates the content from the calls.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass

from mlxkv.server.stop_strings import partial_tail

log = logging.getLogger(__name__)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as the OpenAI API carries it

    def as_openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}

    def input(self) -> dict:
        """The arguments as an object, as the Anthropic API carries them."""
        try:
            value = json.loads(self.arguments)
        except json.JSONDecodeError:
            return {}
        return value if isinstance(value, dict) else {"value": value}


def tool_calling(tokenizer) -> tuple[str, str, object] | None:
    """(start, end, parser) when the model's tokenizer knows its tool calls, else None."""
    if not getattr(tokenizer, "has_tool_calling", False):
        return None
    return tokenizer.tool_call_start, tokenizer.tool_call_end, tokenizer.tool_parser


class ToolCallSplitter:
    """Content text and tool calls out of a reply's text deltas."""

    def __init__(self, start: str, end: str, parser, tools: list | None):
        self.start, self.end, self.parser, self.tools = start, end, parser, tools
        self._buffer = ""
        self._in_call = False
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content safe to send, calls completed by this delta)."""
        self._buffer += text
        content, done = "", []
        while True:
            marker = self.end if self._in_call else self.start
            if not marker:  # no end marker (Mistral's [TOOL_CALLS]...): the calls run to the reply's end
                break
            at = self._buffer.find(marker)
            if at < 0:
                break
            piece, self._buffer = self._buffer[:at], self._buffer[at + len(marker):]
            if self._in_call:
                done += self._parse(piece)
            else:
                content += piece
            self._in_call = not self._in_call
        if not self._in_call:  # hold back only what could start a call
            keep = partial_tail(self._buffer, [self.start])
            content += self._buffer[:len(self._buffer) - keep]
            self._buffer = self._buffer[len(self._buffer) - keep:]
        self.calls += done
        return content, done

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the reply's end: held text, and a call the reply left open (cut by max_tokens, say)."""
        rest, self._buffer = self._buffer, ""
        if self._in_call:
            done = self._parse(rest)
            self.calls += done
            return "", done
        return rest, []

    def _parse(self, text: str) -> list[ToolCall]:
        try:
            parsed = self.parser(text, self.tools)
        except Exception as e:  # a model's malformed call is its content's problem, not the server's
            log.warning("could not parse a tool call (%s: %s)", type(e).__name__, e)
            return []
        calls = []
        for item in parsed if isinstance(parsed, list) else [parsed]:
            if not isinstance(item, dict) or "name" not in item:
                continue
            args = item.get("arguments", {})
            text_args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            # A fresh id per call, never the parser's: Kimi's `functions.name:i` (and a model's own
            # ids) repeat across turns, and a client keys results by id.
            calls.append(ToolCall(f"call_{uuid.uuid4().hex[:24]}", str(item["name"]), text_args))
        return calls

