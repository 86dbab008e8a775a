"""One fleet gateway, assembled: ``FleetGateway.open(config)`` brings up what `aenv
gateway` runs (aenv_fleet's ``Gateway`` over the fleet's Redis, listening) and closes it
again, for the CLI and for tests that want a gateway in-process."""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Callable

from aenv_fleet.config import GatewayConfig
from aenv_fleet.gateway.app import Gateway
from aenv_fleet.trust import gateway_trust, refuse_open_redis

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
    async def open(cls, config: GatewayConfig, data_dir: Path, *, report: Callable[[str], None] = log.info
                   ) -> AsyncIterator[FleetGateway]:
        """Listen on ``config.host:port`` (a Redis not answering yet is reported, and
        retried every second); leaving the block closes the gateway. Raises
        ``StartError`` when it cannot listen, ``ConfigError`` when the fleet's secrets
        are missing (files relative to ``data_dir``) or its Redis takes commands
        without a password (unless ``insecure_redis``)."""
        trust = gateway_trust(config, data_dir)
        gateway = Gateway(config, trust)
        try:
            if not await refuse_open_redis(trust, gateway.coord.redis):
                report(f"warning: redis {gateway.coord.url} unreachable; serving 503 until it answers "
                       f"(and is checked to ask for a password), retrying every second")
            elif trust.insecure_redis:
                report("warning: gateway.insecure_redis: the fleet's Redis is not required to ask for a password "
                       "(a development fleet)")
            try:
                port = await gateway.start(config.host, config.port)
            except OSError as e:
                raise StartError(f"cannot listen on {config.host}:{config.port}: {e}") from None
            url = local_url(config.host, port)
            report(f"listening on {url} (fleet redis {gateway.coord.url}, {len(gateway.fleet.alive())} node(s) up)")
            yield cls(config=config, url=url, port=port, gateway=gateway)
        finally:
            await gateway.close()
