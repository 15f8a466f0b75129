"""Redis stream and key names, in one place.

Everything lives under `meshllm:<cluster>:`. Per-worker-group streams carry a Redis Cluster hash
tag `{g<group>}` so one group's steps and results land on one shard.
"""

from __future__ import annotations


class Streams:
    def __init__(self, cluster: str = "default") -> None:
        self.prefix = f"meshllm:{cluster}"

    @property
    def requests(self) -> str:
        """Gateway -> schedulers (one consumer group `schedulers`)."""
        return f"{self.prefix}:requests"

    def group_requests(self, group: str) -> str:
        """Gateway -> the scheduler of one worker group, chosen by the gateway's router (read
        through the consumer group `schedulers`, like `requests`; a dead group's entries are
        adopted by live groups, services/scheduler/peer_groups.py)."""
        return f"{self.prefix}:{{g{group}}}:requests"

    def progress(self, request_stream: str) -> str:
        """The progress checkpoints (a hash: request id -> ProgressCheckpoint) of the requests
        read from `request_stream` (`requests`, or one group's `group_requests`, keeping its
        hash tag). Keyed by the entry's stream, not by the group running it, because a
        scheduler adopting an entry knows only where the entry is: whoever runs a request
        writes its checkpoints there, and whoever takes the entry over reads them there."""
        return f"{request_stream}:progress"

    @property
    def kv_events(self) -> str:
        """Schedulers -> every gateway (fan-out): prefix blocks stored and removed (KVEvents)."""
        return f"{self.prefix}:kvevents"

    @property
    def aborts(self) -> str:
        """Gateway -> every scheduler (fan-out: plain XREAD, no group)."""
        return f"{self.prefix}:aborts"

    @property
    def handoff(self) -> str:
        """Prefill schedulers -> decode schedulers (consumer group `decoders`): requests whose
        prompt KV a prefill group stored in the offload tier (services/scheduler/pd)."""
        return f"{self.prefix}:handoff"

    @property
    def heartbeats(self) -> str:
        return f"{self.prefix}:heartbeats"

    @property
    def deadletter(self) -> str:
        return f"{self.prefix}:deadletter"

    def steps(self, group: str) -> str:
        """Scheduler -> the worker(s) of one group."""
        return f"{self.prefix}:{{g{group}}}:steps"

    def results(self, group: str) -> str:
        """Worker rank 0 -> the group's scheduler."""
        return f"{self.prefix}:{{g{group}}}:results"

    def control(self, group: str) -> str:
        """Worker -> scheduler announcements (WorkerReady) for one group."""
        return f"{self.prefix}:{{g{group}}}:control"

    def replies(self, gateway_id: str) -> str:
        """Scheduler -> one gateway instance (TokenDelta)."""
        return f"{self.prefix}:replies:{gateway_id}"

    def calls(self, service: str) -> str:
        """Request/reply calls to `service` (shared.rpc), read by its replicas through the
        consumer group RPC_GROUP."""
        return f"{self.prefix}:calls:{service}"

    def rpc_replies(self, service: str, instance: str) -> str:
        """The answers to the calls one instance of `service` makes (shared.rpc); only it reads
        them. Every name under `rpc_reply_prefix` is such a stream and nothing else is."""
        return f"{self.rpc_reply_prefix}{service}:{instance}"

    @property
    def rpc_reply_prefix(self) -> str:
        return f"{self.prefix}:rpc:"


def trimmed_by_age(stream: str) -> bool:
    """How a stream is kept bounded (shared.bus). Streams read through a consumer group
    (`requests`, a group's `requests`, `handoff`, `calls:<service>`; one group each) are
    emptied by their consumers: an entry acked is done, so it is deleted with its XACK, and the
    stream holds what is unread or pending; MAXLEN only guards against a consumer that never
    comes. The dead-letter stream, which no service reads, keeps its last MAXLEN entries. Every
    other stream is fan-out, read by position and never acked (steps, results, control,
    kvevents, aborts, heartbeats, reply streams): those keep `stream_retention_s` of history (60 s)
    (XADD MINID), which bounds them by time at any rate instead of letting each grow to MAXLEN
    entries (100,000 plans or deltas: hundreds of MiB of Redis memory)."""
    tail = stream.rsplit(":", 1)[-1]
    grouped = tail in ("requests", "handoff") or ":calls:" in stream
    return not grouped and tail != "deadletter"


SCHEDULER_GROUP = "schedulers"
DECODE_GROUP = "decoders"  # decode-role schedulers on the handoff stream
RPC_GROUP = "servers"  # the callee's replicas on its `calls` stream
