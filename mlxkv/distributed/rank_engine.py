"""One rank's engine: its shard of the model on a lockstep core (lockstep.py).

Every rank runs this with the same arguments. The split is checked before
any weight loads (sharding.py); each rank then reads only its shard through
mlx-lm's own splits, and the ranks agree that every one of them loaded
before any builds its pool: a rank that failed stops every rank, with its
reason on its own log and its rank on every other.
"""

from __future__ import annotations

import logging
from pathlib import Path

import mlx.core as mx

from mlxkv.config import engine_config
from mlxkv.distributed.channel import PlanChannel
from mlxkv.distributed.cluster import Cluster, join
from mlxkv.distributed.lockstep import LockstepCore, RankLink
from mlxkv.distributed.sharding import ShardSpec, check_checkpoint
from mlxkv.errors import MlxkvError, error_line

log = logging.getLogger(__name__)


def load_rank_engine(model: str, config=None, *, kind: str, cluster: Cluster | None = None, backend: str = "any",
                     check: bool = False, report=lambda text, fraction=None: None, on_lost=lambda message: None):
    """This rank's Engine of `model` split `kind`-wise over the set; rank 0's drives the set,
    every other rank's serves it with `engine.core.follow()`; `on_lost`: LockstepCore's."""
    from mlxkv.engine.core import build_core
    from mlxkv.engine.engine import Engine

    cluster = cluster or join(backend)
    spec = ShardSpec(kind, cluster.size, cluster.rank)
    config = engine_config(config)
    if config.speculation.mode == "draft":
        raise MlxkvError("a draft model is not served by a distributed set yet: use --speculative lookup, or none")
    channel = PlanChannel(cluster)
    loaded = _agreed(channel, lambda: load_shard(model, spec, cluster.group, report))
    report("sizing the KV pool and opening the cache tiers", None)
    core = build_core(loaded, config, lockstep=RankLink(channel, spec))
    return Engine(loaded, config, core=LockstepCore(core, channel, spec, check, on_lost))


def load_shard(name: str, spec: ShardSpec, group, report):
    """This rank's shard of model `name`, its weights read and evaluated."""
    from mlx_lm.utils import load_model  # heavy import; keep `import mlxkv` light

    from mlxkv.models import compat
    from mlxkv.models.fetch import fetch_model
    from mlxkv.models.loader import LoadedModel, check_supported

    path = Path(fetch_model(name, report))
    check_checkpoint(path, spec.kind, spec.size)
    report(f"loading {spec.tag} of {name}", None)
    model, config = load_model(path, lazy=True, strict=False)
    if spec.kind == "tensor":
        model.shard(group)
    else:
        model.model.pipeline(group)
    mx.eval(model.parameters())
    loaded = LoadedModel(model, compat.load_tokenizer(str(path), eos_token_ids=config.get("eos_token_id")), config, name)
    check_supported(loaded)
    return loaded


def _agreed(channel: PlanChannel, load):
    """`load()` on every rank; its result if every rank's succeeded, else one line on each."""
    try:
        result, error = load(), None
    except Exception as e:  # any failure: this rank's reason is logged, every rank stops
        result, error = None, error_line(e, log)
    failed = [rank for rank, flag in enumerate(channel.gather(bytes([error is not None]))) if flag[0]]
    if error is not None:
        raise MlxkvError(f"{channel.cluster.describe()}: {error}")
    if failed:
        raise MlxkvError(f"rank {failed[0]} could not load the model (its log says why); every rank stops")
    return result
