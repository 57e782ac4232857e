"""kv-offload sidecar: per-pod service sharing vLLM's offloaded KV chunks.

Importing this package is cheap and loads neither the operator, kopf nor vLLM.
"""

__version__ = "0.1.0"
