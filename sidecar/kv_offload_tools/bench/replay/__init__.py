"""`kv-offload bench replay`: hit ratios replaying a trace (``cli``)."""
