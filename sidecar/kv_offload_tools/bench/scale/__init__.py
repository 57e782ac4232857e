"""`kv-offload bench scale`: where-is-what as the pool grows (``cli``)."""
