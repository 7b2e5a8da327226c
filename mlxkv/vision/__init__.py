"""Images in the prompt: vision-language models through mlx-vlm (the `vision` extra)."""
