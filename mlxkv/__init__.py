"""mlxkv: paged, prefix-cached KV for local LLM inference on MLX."""

# The BLAS must be loaded before anything imports mlx.core (see blas.py).
from mlxkv import blas as _blas

_blas.load_blas()

__version__ = "0.1.0"
