"""`kv-offload bench attack`: hostile clients against a live pool (``cli``)."""
