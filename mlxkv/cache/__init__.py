"""Where KV lives: block hashes, the block pool, the per-layer KV pool, and the
cache manager that meets a prompt with them."""
