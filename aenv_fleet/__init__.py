"""aenv as a fleet: many nodes behind stateless gateways, coordinated through Redis.

Redis holds placement state (node leases and capacity, sandbox -> node bindings, API
key digests, reservations, events: ``keys.py`` and docs/cluster.md); the shared
repository holds every committed artifact. Nothing in aenv_store, aenv_vm or envd
imports this package.
"""
