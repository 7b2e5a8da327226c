"""The engine host: one engine thread that owns all MLX state, serving other
threads through request handles and pool snapshots (the chat app and the
HTTP server both sit on it)."""
