"""The fleet gateway (``aenv gateway``): app.py serves, forward.py talks to nodes,
list_routes.py/list_merge.py merge reads, placement.py places and moves sandboxes, state.py caches
Redis."""
