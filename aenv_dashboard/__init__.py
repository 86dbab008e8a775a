"""The web dashboard (docs/dashboard.md): static files served at ``/dashboard`` by a node's
``aenv server`` and by a fleet's ``aenv gateway``. The page holds no secret and talks only to
the HTTP API the SDKs use, with the key the user typed; this package only serves its files."""
