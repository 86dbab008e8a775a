"""What every RPC handler gets besides its message."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, Union

from .connect import Code, ConnectError
from .state import EnvdState
from .users import UnknownUser, User

Message = dict[str, Any]


@dataclass(frozen=True)
class RpcContext:
    state: EnvdState
    auth_user: str | None  # from Authorization: Basic
    timeout_ms: int | None
    keepalive_s: float | None  # Keepalive-Ping-Interval

    def user(self) -> User:
        try:
            return self.state.user(self.auth_user)
        except UnknownUser as e:
            raise ConnectError(Code.UNAUTHENTICATED, str(e)) from None

    @property
    def timeout_s(self) -> float | None:
        return None if self.timeout_ms is None else self.timeout_ms / 1000


Unary = Callable[[Message, RpcContext], Awaitable[Message]]
# an async generator: the server closes it (aclose) when the stream ends, finished or not
ServerStream = Callable[[Message, RpcContext], AsyncGenerator[Message, None]]
ClientStream = Callable[[AsyncIterator[Message], RpcContext], Awaitable[Message]]
Handler = Union[Unary, ServerStream, ClientStream]

_KEEPALIVE = object()


async def get_or_keepalive(queue: "asyncio.Queue[Any]", interval: float | None) -> Any:
    """Next queue item, or the KEEPALIVE marker when ``interval`` passes first."""
    if interval is None:
        return await queue.get()
    try:
        return await asyncio.wait_for(queue.get(), interval)
    except asyncio.TimeoutError:
        return _KEEPALIVE


def is_keepalive(item: Any) -> bool:
    return item is _KEEPALIVE
