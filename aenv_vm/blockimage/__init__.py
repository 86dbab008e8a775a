"""Layered block images (overlaybd-style) served over NBD with lazy fetch.
Format and behaviour: docs/block-image.md."""
