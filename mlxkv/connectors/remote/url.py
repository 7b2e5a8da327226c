"""The remote tier's address: its rules are in mlxkv/remote_url.py, below config, which checks it."""

from mlxkv.remote_url import DEFAULT_PORT, SCHEMES, USAGE, check_url, redact  # noqa: F401
