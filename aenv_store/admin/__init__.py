"""Administration of a repository: verify, gc, and the progress and
formatting helpers their CLI shares. Reads through the repository layer
(docs/admin.md)."""
