"""The node cache: a bounded local directory of verified plaintext chunks,
shared by every process of a node (LRU, pins, single flight per chunk).
node_cache.NodeCache is its API; the other modules are its parts (docs/cache.md)."""
