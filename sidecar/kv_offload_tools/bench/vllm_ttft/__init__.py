"""`kv-offload bench vllm`: time to first token inside real vLLM engines (``cli``)."""
