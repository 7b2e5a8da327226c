"""`mlxkv chat`: a Textual chat app with a live view of the KV cache.

Import `mlxkv` first: it loads the real BLAS before anything imports mlx.
"""

import mlxkv  # noqa: F401
