"""Finding, loading and checking mlx-lm models, tiny random ones included, and
the one place (compat.py) that touches mlx-lm internals."""
