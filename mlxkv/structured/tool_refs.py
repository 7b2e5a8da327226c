"""A tool's `$ref`s, given names of their own so the tool's schema can be nested in a call's.

A tool's parameters may name parts of themselves (`"$ref": "#/$defs/Item"`: Pydantic's and
many MCP servers' schemas). A call's grammar nests those parameters (under the call's object,
or one argument at a time), where `#/...` would point into the wrong root. So each place a
tool's refs point to becomes a definition named after the tool's index (`mlxkv_tool0_Item`),
every ref is rewritten to it, and the grammar puts the definitions a value uses at its own
root (`reachable`). Two tools' `Item`s never meet, and a recursive definition stays a ref to
itself. A ref outside the tool's schema, or one that does not resolve, is BadToolSchema.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

from mlxkv.errors import MlxkvError

PREFIX = "#/$defs/"
_ANNOTATIONS = {"description", "title", "default", "examples", "$comment"}
_DATA = ("enum", "const", "default", "examples")  # values, not schemas: a "$ref" in them is text
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


class BadToolSchema(MlxkvError):
    """A tool's schema refers to what it does not hold (a 400 when the tool is enforced)."""


def lift(schema: dict, tool: str, index: int) -> tuple[dict, dict]:
    """(`schema` with its refs rewritten and its own `$defs`/`definitions` taken out, the
    definitions its refs reach by their new names). A root that is only a ref is replaced by
    what it points to, so the formats that write properties one by one see them."""
    lifter = _Lifter(schema, tool, index)
    root = lifter.schema(schema)
    root = {k: v for k, v in root.items() if k not in ("$defs", "definitions")}
    target = lifter.defs.get(ref_name(root))
    if isinstance(target, dict) and "$ref" not in target:
        root = target
    return root, lifter.defs


def reachable(schema, defs: dict) -> dict:
    """The definitions of `defs` that `schema` reaches through refs, directly or not."""
    found, todo = {}, [schema]
    while todo:
        for name in _refs(todo.pop(), set()):
            if name in defs and name not in found:
                found[name] = defs[name]
                todo.append(defs[name])
    return found


def deref(schema, defs: dict):
    """`schema`, or what it refers to when it is only a ref (and annotations): the formats
    that read a property's type see the type."""
    seen = set()
    while isinstance(schema, dict) and set(schema) - _ANNOTATIONS == {"$ref"}:
        name = str(schema["$ref"]).removeprefix(PREFIX)
        if name not in defs or name in seen:
            return schema
        seen.add(name)
        schema = defs[name]
    return schema


def ref_name(schema) -> str | None:
    """The lifted definition's name when `schema` is only a ref to one (and annotations)."""
    if isinstance(schema, dict) and set(schema) - _ANNOTATIONS == {"$ref"}:
        ref = str(schema["$ref"])
        return ref.removeprefix(PREFIX) if ref.startswith(PREFIX) else None
    return None


def _refs(node, out: set) -> set:
    """The definition names a schema's refs name (each rewritten to PREFIX + name)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and value.startswith(PREFIX):
                out.add(value.removeprefix(PREFIX))
            elif key in _SCHEMA_MAPS and isinstance(value, dict):  # keys are names, values schemas
                for schema in value.values():
                    _refs(schema, out)
            elif key not in _DATA:
                _refs(value, out)
    elif isinstance(node, list):
        for value in node:
            _refs(value, out)
    return out


class _Lifter:
    def __init__(self, root: dict, tool: str, index: int):
        self.root, self.tool, self.index = root, tool, index
        self.names: dict[tuple, str] = {}  # a target's path in the root -> its definition's name
        self.defs: dict[str, dict] = {}

    def schema(self, node):
        """A schema with its refs rewritten (and their targets lifted)."""
        if isinstance(node, list):
            return [self.schema(s) for s in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                out[key] = PREFIX + self._name(value)
            elif key in _SCHEMA_MAPS and isinstance(value, dict):
                out[key] = {k: self.schema(s) for k, s in value.items()}
            elif key in _DATA:
                out[key] = value
            else:
                out[key] = self.schema(value)
        return out

    def _name(self, ref: str) -> str:
        path = self._path(ref)
        if path not in self.names:
            slug = re.sub(r"[^A-Za-z0-9_]", "_", str(path[-1]) if path else "root")
            name = f"mlxkv_tool{self.index}_{slug}"
            if name in self.defs:
                name = f"{name}_{len(self.defs)}"
            self.names[path] = name
            self.defs[name] = {}  # taken before the target is rewritten: it may refer to itself
            target = self.schema(self._target(ref, path))
            if path == ():  # the root again: its definitions are lifted already
                target = {k: v for k, v in target.items() if k not in ("$defs", "definitions")}
            self.defs[name] = target
        return self.names[path]

    def _path(self, ref: str) -> tuple:
        if not ref.startswith("#"):
            raise BadToolSchema(f"tool {self.tool!r}: $ref {ref!r} points outside the tool's schema "
                                f"(only #/... refs within it are followed)")
        pointer = unquote(ref[1:])
        if pointer and not pointer.startswith("/"):
            raise BadToolSchema(f"tool {self.tool!r}: $ref {ref!r} does not resolve (anchors are not followed)")
        return tuple(p.replace("~1", "/").replace("~0", "~") for p in pointer.split("/")[1:])

    def _target(self, ref: str, path: tuple):
        node = self.root
        for part in path:
            if isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            elif isinstance(node, dict) and part in node:
                node = node[part]
            else:
                raise BadToolSchema(f"tool {self.tool!r}: $ref {ref!r} does not resolve in its schema")
        if not isinstance(node, (dict, bool)):
            raise BadToolSchema(f"tool {self.tool!r}: $ref {ref!r} does not point to a schema")
        return node
