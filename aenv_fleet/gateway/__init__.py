"""The fleet gateway (``aenv gateway``): app.py serves, forward.py talks to nodes,
lists.py/listing.py merge reads, moves.py places and moves sandboxes, state.py caches
Redis."""
