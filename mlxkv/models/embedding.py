"""Text embeddings from a decoder model: its last token's final hidden state, normalized.

Decoder embedding models (Qwen3-Embedding and its kind) are causal language
models trained so that the hidden state at a text's last token sums it up.
mlx-lm's model classes give that state: the inner model (`model.model`)
returns the final norm's output before the LM head. A batch is padded on
the right; under the causal mask a row's real tokens never see its padding,
so each row's vector equals the one it gets alone (to float tolerance).
"""

from __future__ import annotations

import mlx.core as mx

EMBEDDING = "embedding"
CHAT = "chat"
BATCH = 16  # texts per forward pass


def model_kind(config: dict) -> str:
    """"embedding" for a checkpoint whose architecture is a bare model (Qwen3Model), without
    a language-model head class (Qwen3ForCausalLM); "chat" otherwise."""
    architectures = config.get("architectures") or []
    bare = [a for a in architectures if a.endswith("Model") and "For" not in a]
    return EMBEDDING if architectures and len(bare) == len(architectures) else CHAT


def last_token_embeddings(model, token_lists: list[list[int]], batch: int = BATCH) -> list[mx.array]:
    """One L2-normalized vector per token list (each non-empty)."""
    inner = getattr(model, "model", model)
    vectors: list[mx.array] = []
    for start in range(0, len(token_lists), batch):
        rows = token_lists[start:start + batch]
        width = max(len(r) for r in rows)
        ids = mx.array([r + [0] * (width - len(r)) for r in rows])
        hidden = inner(ids).astype(mx.float32)  # [rows, width, hidden]
        last = hidden[mx.arange(len(rows)), mx.array([len(r) - 1 for r in rows])]
        last = last / mx.maximum(mx.linalg.norm(last, axis=-1, keepdims=True), 1e-12)
        mx.eval(last)
        vectors += [last[i] for i in range(len(rows))]
    return vectors
