"""The remote tier: a Redis or Valkey server many processes share (connector.py)."""
