"""The chunk store: fixed-budget LRU of checksummed chunk slots in one shared-memory file."""
