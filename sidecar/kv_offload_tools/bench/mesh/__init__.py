"""`kv-offload bench mesh`: many real sidecars on this host (``cli``)."""
