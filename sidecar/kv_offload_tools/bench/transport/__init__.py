"""`kv-offload bench transport`: data-plane throughput against raw sockets (``cli``)."""
