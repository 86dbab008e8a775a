"""One fleet gateway, assembled: ``FleetGateway.open(config)`` brings up what `aenv
gateway` runs (aenv_fleet's ``Gateway`` over the fleet's Redis, listening) and closes it
again, for the CLI and for tests that want a gateway in-process."""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from aenv_fleet.config import GatewayConfig
from aenv_fleet.coord import CoordError
from aenv_fleet.gateway.app import Gateway

from .common import StartError, local_url

log = logging.getLogger("aenv.gateway")


@dataclass(frozen=True)
class FleetGateway:
    """A running gateway: where it listens and its parts."""

    config: GatewayConfig
    url: str                 # http://HOST:PORT of the E2B API and the sandbox proxy of the fleet
    port: int
    gateway: Gateway

    def sdk_env(self) -> dict[str, str]:
        """The variables an E2B SDK client sets to use this gateway (what `aenv gateway` prints;
        the API key is the nodes')."""
        return {"E2B_API_URL": self.url, "E2B_SANDBOX_URL": self.url}

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, config: GatewayConfig, *, report: Callable[[str], None] = log.info
                   ) -> AsyncIterator[FleetGateway]:
        """Listen on ``config.host:port`` (a Redis not answering yet is reported, and
        retried every second); leaving the block closes the gateway. Raises
        ``StartError`` when it cannot listen."""
        gateway = Gateway(config)
        try:
            try:
                await gateway.coord.ping()
            except CoordError as e:
                report(f"warning: {e}; serving, and retrying every second")
            try:
                port = await gateway.start(config.host, config.port)
            except OSError as e:
                raise StartError(f"cannot listen on {config.host}:{config.port}: {e}") from None
            url = local_url(config.host, port)
            report(f"listening on {url} (fleet redis {config.redis_url}, {len(gateway.fleet.alive())} node(s) up)")
            yield cls(config=config, url=url, port=port, gateway=gateway)
        finally:
            await gateway.close()
