"""Which way a model can be split over N ranks, checked before any weight loads.

mlx-lm does the splitting: tensor parallel through the model's `shard(group)`
(q, k and v split by head, o_proj and down_proj summed across ranks), pipeline
parallel through `model.model.pipeline(group)` (contiguous layer ranges). A
family without the method, or a head count N does not divide, would fail deep
inside mlx-lm (or, for heads, reshape to an empty array), so each rank checks
first from the config and a lazily built model, and stops with one line.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxkv.errors import MlxkvError, first_line

KINDS = ("tensor", "pipeline")


@dataclass(frozen=True)
class ShardSpec:
    """How this rank's weights and KV relate to the whole model's."""

    kind: str
    size: int
    rank: int

    def __post_init__(self):
        if self.kind not in KINDS:
            raise MlxkvError(f"unknown --distributed mode {self.kind!r}: use tensor or pipeline")
        if not 0 <= self.rank < self.size:
            raise MlxkvError(f"rank {self.rank} is outside a set of {self.size}")

    @property
    def tag(self) -> str:
        """A tier key's and file name's mark of the shard: a rank reads only its own bytes."""
        return f"{self.kind[0]}p{self.size}r{self.rank}"


def _text_config(config: dict) -> dict:
    return config.get("text_config", config)


def check_shardable(model, config: dict, kind: str, size: int) -> None:
    """Raise a one-line MlxkvError when `model` (built lazily, no weights read) cannot be
    split `kind`-wise over `size` ranks; return quietly when it can."""
    family = config.get("model_type", "this model")
    if kind == "tensor":
        if not hasattr(model, "shard"):
            raise MlxkvError(f"{family} has no tensor-parallel split in mlx-lm: "
                             f"try --distributed pipeline, or one Mac")
        text = _text_config(config)
        heads = text.get("num_attention_heads")
        kv_heads = text.get("num_key_value_heads", heads)
        for name, count in (("attention heads", heads), ("KV heads", kv_heads)):
            if count is not None and count % size:
                raise MlxkvError(f"{family} has {count} {name}, which {size} ranks cannot split evenly: "
                                 f"use a rank count that divides {count}")
    elif kind == "pipeline":
        inner = getattr(model, "model", None)
        if not hasattr(inner, "pipeline"):
            raise MlxkvError(f"{family} has no pipeline split in mlx-lm: try --distributed tensor, or one Mac")
        layers = len(getattr(inner, "layers", ()))
        if layers < size:
            raise MlxkvError(f"{family} has {layers} layers, fewer than the {size} pipeline stages")
    else:
        ShardSpec(kind, size, 0)  # raises the unknown-mode line


def check_checkpoint(path, kind: str, size: int) -> None:
    """`check_shardable` on an mlx-lm checkpoint directory, building the model lazily: no
    weight is read, so every rank can refuse in a second, before a multi-GB load."""
    from mlx_lm.utils import load_model  # heavy import; keep `import mlxkv` light

    try:
        model, config = load_model(path, lazy=True, strict=False)
    except Exception as e:  # a missing or foreign checkpoint: mlx-lm raises many kinds
        raise MlxkvError(f"could not read the model at {path} to split it: {first_line(e)}") from None
    check_shardable(model, config, kind, size)
