"""Request/reply envelopes (shared.rpc): what every call and every answer carries.

A call type subclasses `RpcRequest`, its answer `RpcReply`; both are registered like any other
message. The rpc client fills the envelope fields, so code building a request names only what
the call is about. The server checks the envelope before any work (shared.rpc.envelope): a
request without a correlation id, or whose reply stream is outside the rpc reply namespace, is
dead-lettered, never answered, so no request can make a service write to a key of its choice.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from shared.protocol.base import Message, register

ErrorKind = Literal["bad_request", "unavailable", "internal"]
"""Why a call failed on the server: the request itself is wrong (a 400 for a client), the
service cannot do it now (its dependency is down: a 503), or a handler bug."""


class RpcRequest(Message):
    """Base of every call. `deadline` is the Unix time after which the caller no longer waits:
    a server skips a request whose deadline passed (hosts' clocks are assumed NTP-close; a
    skew only shifts when stale work is dropped, never correctness)."""

    correlation_id: str = Field("", max_length=64)
    reply_stream: str = Field("", max_length=512)
    deadline: float = Field(0.0, ge=0.0)


class RpcReply(Message):
    """Base of every answer; `correlation_id` is the request's."""

    correlation_id: str = Field("", max_length=64)


@register
class RpcErrorReply(RpcReply):
    """The answer of a call that failed on the server (the client raises `RpcError`)."""

    TYPE = "rpc_error"
    VERSION = 1

    kind: ErrorKind
    message: str = Field(max_length=4096)


@register
class Ping(RpcRequest):
    """Answered by every rpc server itself: is anyone serving this stream now?"""

    TYPE = "rpc_ping"
    VERSION = 1


@register
class Pong(RpcReply):
    TYPE = "rpc_pong"
    VERSION = 1

    service: str = Field(max_length=64)
    instance_id: str = Field(max_length=256)
