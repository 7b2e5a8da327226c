"""Encoder embedding models (BERT, XLM-R, ModernBERT) through mlx-embeddings.

An encoder reads a whole text at once with no KV cache, so it needs neither
mlx-lm nor the pool: mlx-embeddings, the maintained MLX package for these
models, has their classes, weight loading and tokenizers, and its models
give the embedding they were trained for (`text_embeds`: mean-pooled over the
real tokens, normalized). It is an optional extra (`mlxkv[embeddings]`), so
a checkpoint of an encoder family without it is a one-line refusal naming it.

A batch is padded on the right with an attention mask, so each row's vector
equals the one it gets alone (to float tolerance).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mlxkv.errors import MlxkvError, first_line

log = logging.getLogger(__name__)

FAMILIES = {"bert": "BERT", "xlm-roberta": "XLM-R", "xlm_roberta": "XLM-R", "modernbert": "ModernBERT"}
EXTRA = "embeddings"
BATCH = 16  # texts per forward pass


def encoder_family(config: dict) -> str | None:
    """"BERT", "XLM-R" or "ModernBERT" for a checkpoint of an encoder family; None otherwise."""
    return FAMILIES.get(str(config.get("model_type", "")).lower())


def checkpoint_config(source: str) -> dict:
    """The config.json of a model already on this machine ({} when it is not, or has none)."""
    from mlxkv.models.fetch import cached, local_model

    try:
        path = local_model(source) or cached(source)
        return json.loads((Path(path) / "config.json").read_text()) if path else {}
    except (MlxkvError, OSError, ValueError):  # the model's own load says what is wrong with it
        return {}


@dataclass
class Encoder:
    model: object  # an mlx-embeddings model class
    tokenizer: object  # mlx-embeddings' TokenizerWrapper (a Hugging Face tokenizer inside)
    config: dict
    name: str

    @property
    def pad_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return int(pad if pad is not None else self.config.get("pad_token_id") or 0)

    @property
    def max_context(self) -> int | None:
        """Tokens per input: XLM-R's position table keeps its first pad_token_id + 1 rows unused."""
        positions = self.config.get("max_position_embeddings")
        if positions is None or encoder_family(self.config) != "XLM-R":
            return positions
        return positions - int(self.config.get("pad_token_id", 1)) - 1

    @property
    def nbytes(self) -> int:
        from mlx.utils import tree_flatten

        return sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))


def load_encoder(source: str) -> Encoder:
    """Load an encoder checkpoint (a local path or a Hugging Face id) with mlx-embeddings."""
    from mlxkv.models.fetch import fetch_model

    path = fetch_model(source, lambda what, fraction: None)
    config = checkpoint_config(path)
    family = encoder_family(config) or config.get("model_type", "unknown")
    try:
        from mlx_embeddings.utils import load
    except ImportError:
        raise MlxkvError(f"model {source!r} is an embedding model ({family}); serving it needs mlxkv's "
                         f"`{EXTRA}` extra: pip install 'mlxkv[{EXTRA}]'") from None
    try:
        model, tokenizer = load(path)
    except Exception as e:  # mlx-embeddings raises many kinds; the user needs one line
        log.debug("loading %s failed", source, exc_info=True)
        raise MlxkvError(f"could not load embedding model {source!r}: {first_line(e)}") from None
    return Encoder(model, tokenizer, config, source)


def encoder_embeddings(encoder: Encoder, token_lists: list[list[int]], batch: int = BATCH) -> np.ndarray:
    """One normalized vector per token list (each non-empty), as rows of a float32 array."""
    import mlx.core as mx

    rows = []
    for start in range(0, len(token_lists), batch):
        chunk = token_lists[start:start + batch]
        width = max(len(r) for r in chunk)
        ids = mx.array([r + [encoder.pad_id] * (width - len(r)) for r in chunk])
        mask = mx.array([[1] * len(r) + [0] * (width - len(r)) for r in chunk])
        vectors = encoder.model(ids, attention_mask=mask).text_embeds.astype(mx.float32)
        rows.append(np.array(vectors))
    return np.concatenate(rows)
