"""Peer-to-peer sharing of committed chunks between nodes over iroh (QUIC).

protocol.py  the request/response framing (sans-IO) on ALPN ``aenv/chunks/1``
node.py      an iroh endpoint per node: serves chunks, asks peers, counts traffic
peers.py     the peer table, its persistence and the status file
source.py    the chunk source of the read chain (between node cache and repository) and
             what a node serves; aenv_store/assembly.py composes them into a Store
See docs/remote.md."""
