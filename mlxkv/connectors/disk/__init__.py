"""The SSD tier: block runs as safetensors files under a directory per model."""
