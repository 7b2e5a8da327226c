"""Chat prompts from a tokenizer alone: templates, reply ids and context fitting."""
