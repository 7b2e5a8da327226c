"""One manager per layer kind (full, sliding, chunked, recurrent): each owns its rule over the one pool."""
