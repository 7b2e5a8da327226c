"""How attention reads the pool: the per-layer paged caches mlx-lm models talk
to, the dispatch between the reference path and the Metal kernels, and
cascade attention for batches that share a prefix."""
