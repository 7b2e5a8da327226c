"""mlxkv: paged, prefix-cached KV for local LLM inference on MLX.

    from mlxkv import Engine, CacheConfig
"""

import logging

# A library leaves where its log goes to the program (system/logs.py).
logging.getLogger(__name__).addHandler(logging.NullHandler())

# The BLAS must be loaded before anything imports mlx.core (see system/blas.py).
from mlxkv.system import blas as _blas  # noqa: E402

_blas.load_blas()

__version__ = "0.1.0"

_EXPORTS = {"Engine": "mlxkv.engine.engine", "CacheConfig": "mlxkv.config", "MlxkvError": "mlxkv.errors"}


def __getattr__(name: str):
    # Imported on first use, so `import mlxkv` stays light (and BLAS-first).
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mlxkv' has no attribute {name!r}")


__all__ = ["CacheConfig", "Engine", "MlxkvError", "__version__"]
