"""Request/reply between services over the bus (ARCHITECTURE.md, "Messaging rules").

A call is a typed request (shared.protocol.rpc.RpcRequest) on the callee's `calls` stream; the
answer comes back on the calling instance's own reply stream, matched by correlation id, within
the call's timeout. Reading order: `errors` (what a caller can get instead of an answer),
`envelope` (correlation ids, reply-stream and deadline rules; pure), `pending` (calls awaiting
their answer; pure), `client` (send, wait, one reply reader per process), `server` (consumer
group, handlers, error answers, claiming a dead replica's requests).
"""

from shared.rpc.client import RpcClient
from shared.rpc.errors import RpcCallError, RpcError, RpcTimeout, RpcUnavailable
from shared.rpc.server import Handler, RpcServer

__all__ = [
    "Handler",
    "RpcCallError",
    "RpcClient",
    "RpcError",
    "RpcServer",
    "RpcTimeout",
    "RpcUnavailable",
]
