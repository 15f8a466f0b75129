"""How a call fails, as the caller sees it: no answer in time, no way to ask, or an error answer.

Handlers raise `RpcError` too, to answer with a chosen error kind (a refusal is "bad_request",
a dependency down "unavailable"); any other exception in a handler is answered as "internal".
"""

from __future__ import annotations

from shared.protocol.rpc import ErrorKind


class RpcCallError(Exception):
    """A call that got no usable answer; the three cases below."""


class RpcTimeout(RpcCallError):
    """No reply within the call's timeout (the callee is down, stuck or overloaded)."""


class RpcUnavailable(RpcCallError):
    """The call could not be sent: Redis is unreachable, or nobody ever served the stream."""


class RpcError(RpcCallError):
    """The callee answered with an error (`kind`: bad_request, unavailable or internal)."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind: ErrorKind = kind
        self.message = message
