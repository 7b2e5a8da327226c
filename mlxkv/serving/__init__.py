"""Serving one engine to other threads: the engine thread, request handles and
pool snapshots."""
