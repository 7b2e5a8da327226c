"""A request's constraint: what its reply must match, as a small typed value.

A `Grammar` is one of the kinds llguidance compiles: a JSON schema, any
JSON object, a Lark grammar or a regular expression. Tool-call forms are
Lark grammars built from the model's own call markers (tool_grammar.py).
It is a frozen value, so it hashes: the compile cache keys on it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from mlxkv.errors import MlxkvError

KINDS = ("json_schema", "json_object", "lark", "regex")
# Compact JSON: a model's reply spends no tokens on free whitespace (llguidance's default allows any).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Grammar:
    kind: str
    source: str  # the schema as JSON text, the Lark grammar, or the regex ("" for json_object)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise MlxkvError(f"unknown grammar kind {self.kind!r}; choose one of: {', '.join(KINDS)}")
        if not isinstance(self.source, str):
            raise MlxkvError(f"a {self.kind} grammar's source must be text, got {type(self.source).__name__}")

    @classmethod
    def json_schema(cls, schema: dict | str) -> Grammar:
        """A reply that is JSON valid against `schema` (a dict, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise MlxkvError(f"the JSON schema is not JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise MlxkvError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema, sort_keys=False, separators=(",", ":")))

    @classmethod
    def json_object(cls) -> Grammar:
        return cls("json_object", "")

    @classmethod
    def lark(cls, text: str) -> Grammar:
        return cls("lark", text)

    @classmethod
    def regex(cls, text: str) -> Grammar:
        return cls("regex", text)

    def llguidance(self) -> str:
        """The grammar in llguidance's own form (what LLMatcher takes)."""
        import llguidance

        if self.kind == "lark":
            return llguidance.grammar_from("lark", self.source)
        if self.kind == "regex":
            return llguidance.grammar_from("regex", self.source)
        schema = {"type": "object"} if self.kind == "json_object" else json.loads(self.source)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)

    def describe(self) -> str:
        """A short name for logs: the kind and the source's first characters."""
        text = self.source if len(self.source) <= 60 else self.source[:57] + "..."
        return self.kind if not text else f"{self.kind} {text!r}"
