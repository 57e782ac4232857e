"""`kv-offload bench gpu`: recompute on the GPU against a peer hit (``cli``)."""
