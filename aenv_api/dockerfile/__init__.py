"""Dockerfiles as E2B template builds (the client side of `aenv template build -f`).

- ``syntax``: Dockerfile text → instructions (directives, comments, continuations,
  heredocs) and Docker's word rules (quotes, escapes, ``$VAR`` substitution).
- ``convert``: instructions → a ``BuildPlan``: the E2B ``TemplateBuildStartV2``
  steps, start and ready commands, the COPY sources to upload.
- ``context``: the build context on disk: ``.dockerignore``, glob sources, the
  checks that keep a COPY inside the context, the files hash and the tar.

Pure Python, stdlib only (the CLI imports it). See docs/templates.md.
"""
from __future__ import annotations


class DockerfileError(ValueError):
    """A Dockerfile that cannot be built: the message names the line."""

    def __init__(self, message: str, line: int | None = None) -> None:
        self.line = line
        self.reason = message
        super().__init__(f"Dockerfile line {line}: {message}" if line else f"Dockerfile: {message}")
