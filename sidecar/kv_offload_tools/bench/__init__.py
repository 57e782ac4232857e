"""Benchmarks behind `kv-offload bench ...`: each prints ratios measured within one run."""
