"""The server's contexts: created, listed, removed, restarted; one default context per
language (what ``run_code`` without a context uses), made on first use."""
from __future__ import annotations

import asyncio
import logging
import uuid
from pathlib import Path

from .bash import BashContext
from .context import CodeContext
from .kernel import PythonContext

log = logging.getLogger(__name__)


class UnknownContext(KeyError):
    pass


class Contexts:
    def __init__(self, log_dir: Path, default_cwd: str) -> None:
        self.log_dir = log_dir
        self.default_cwd = default_cwd
        self._by_id: dict[str, CodeContext] = {}
        self._defaults: dict[str, str] = {}
        self._default_lock = asyncio.Lock()

    def _make(self, language: str, cwd: str) -> CodeContext:
        cid = str(uuid.uuid4())
        if language == "python":
            return PythonContext(cid, cwd, self.log_dir)
        if language == "bash":
            return BashContext(cid, cwd)
        raise ValueError(language)      # protocol.normalize_language let no other through

    async def create(self, language: str, cwd: str) -> CodeContext:
        ctx = self._make(language, cwd)
        await ctx.start()
        self._by_id[ctx.id] = ctx
        log.info("context %s (%s) in %s", ctx.id, language, cwd)
        return ctx

    async def default(self, language: str) -> CodeContext:
        async with self._default_lock:
            cid = self._defaults.get(language)
            if cid is not None and cid in self._by_id:
                return self._by_id[cid]
            ctx = await self.create(language, self.default_cwd)
            self._defaults[language] = ctx.id
            return ctx

    def get(self, cid: str) -> CodeContext:
        try:
            return self._by_id[cid]
        except KeyError:
            raise UnknownContext(cid) from None

    def all(self) -> list[CodeContext]:
        return list(self._by_id.values())

    def has_default(self, language: str) -> bool:
        cid = self._defaults.get(language)
        return cid is not None and cid in self._by_id

    async def remove(self, cid: str) -> None:
        ctx = self.get(cid)
        del self._by_id[cid]
        for lang, d in list(self._defaults.items()):
            if d == cid:
                del self._defaults[lang]
        async with ctx.lock:     # a running cell finishes (or is interrupted by its client) first
            await ctx.close()

    async def close(self) -> None:
        for ctx in self.all():
            await ctx.close()
        self._by_id.clear()
