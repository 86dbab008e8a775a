"""The repository layer: packs, index, manifests and catalog records on a
backend (``backends/``: bytes by key), and the repository locks that writers
and gc take. The source of truth every node reads from."""
