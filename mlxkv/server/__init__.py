"""`mlxkv serve`: the HTTP APIs (OpenAI chat completions and Responses,
Anthropic Messages) over one engine host (mlxkv/host/)."""
