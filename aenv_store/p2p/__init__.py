"""Peer-to-peer sharing of committed chunks between nodes over iroh (QUIC).

protocol.py  the request/response framing (sans-IO) on ALPN ``aenv/chunks/1``
node.py      an iroh endpoint per node: serves chunks, asks peers, counts traffic
peers.py     the peer table, its persistence and the status file
source.py    the chunk source the Store consults between node cache and repository
See docs/remote.md."""
