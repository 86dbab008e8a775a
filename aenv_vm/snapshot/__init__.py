"""Pause, resume, named snapshots and fork of microVM sandboxes (docs/snapshots.md)."""
