"""envd: the in-sandbox daemon speaking E2B's envd protocol (stdlib only)."""
