"""aenv's E2B-compatible HTTP server: control-plane API, envd reverse proxy,
auth, metrics. ``app.build_app`` assembles it; ``aenv server`` runs it."""
