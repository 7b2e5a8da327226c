"""Structured output: grammars (JSON schemas, tool calls, Lark, regexes) enforced on a row's tokens.

llguidance compiles a grammar (compiler.py) into a matcher per row
(matcher.py); each step the batch's constrained rows get their token masks
in one call and the masks are applied to the logits before sampling
(masks.py). Rows without a grammar never reach this package.
"""

# The constraint a caller passes: Engine.generate(..., grammar=Grammar.json_schema(schema)).
from mlxkv.structured.grammar import Grammar  # noqa: F401
