"""`mlxkv chat`: a Textual chat app with a live view of the KV cache.

Lives in the repository's top-level tui/ folder and installs as `mlxkv.tui`.
"""
