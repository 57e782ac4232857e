"""`kv-offload bench netns`: pods in network namespaces under partitions (``cli``)."""
