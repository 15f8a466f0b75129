"""Render the Redis ACL file: one user per service, allowed only its own keys and streams.

Passwords come from `MESHLLM_REDIS_PASSWORD_<USER>` (dev defaults below, never real secrets)
and are written as SHA-256 hashes, so the rendered file holds no plain password. The default
user is disabled: a client that does not authenticate can do nothing.

Key permissions (Redis 7): `~p` read+write, `%R~p` read only, `%W~p` write only. A stream
command needs what its key spec says: XADD, XACK and EXPIRE only write; XREAD only reads;
XREADGROUP, XAUTOCLAIM and XGROUP CREATE both read and write (they move the consumer group's
state). Calls between services (shared.rpc): the caller may only append to the `calls` stream
of the services it calls and read its own service's reply streams; the callee consumes its own
`calls` stream and may only write (answer, expire) the reply streams of its callers.
The cluster name is `*` in every pattern, so one ACL file serves any number of clusters.

Run: `python -m infra.redis.render_acl [--out FILE]` (stdout without --out). Used by the
`redis-acl` compose service and by the local launcher.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

# Commands every service user may run: redis-py's connection set-up (HELLO, SELECT, CLIENT
# SETNAME), PING for readiness, INFO for diagnostics. CLIENT SETINFO (Redis >= 7.2) is left out
# on purpose: naming it fails on 7.0, and redis-py ignores its refusal. Data commands come from
# categories and are confined by key patterns; @dangerous (FLUSHALL, KEYS, CONFIG, DEBUG, ...)
# is removed before the few connection commands of that category are added back.
BASE_COMMANDS = (
    "-@all +@read +@write +@stream +@keyspace +@string +@hash +@sortedset +@list +@set"
    " +@connection +@transaction +@scripting -@dangerous -@admin -@pubsub"
    " +info +client|id +client|setname +client|getname +hello +select"
)

COMMON_KEYS = (
    "%W~meshllm:*:heartbeats",  # liveness beats (XADD only)
    "%W~meshllm:*:deadletter",  # undecodable entries moved aside by the bus
)


@dataclass(frozen=True)
class AclUser:
    name: str
    keys: tuple[str, ...]
    selectors: tuple[str, ...] = field(default=())
    commands: str = BASE_COMMANDS

    @property
    def password_env(self) -> str:
        return f"MESHLLM_REDIS_PASSWORD_{self.name.upper()}"

    @property
    def dev_password(self) -> str:
        return f"meshllm-dev-{self.name}"


def _service(name: str, *keys: str, selectors: tuple[str, ...] = ()) -> AclUser:
    own_state = f"~meshllm:*:state:{name}:*"
    return AclUser(name, (*keys, *COMMON_KEYS, own_state), selectors)


SERVICE_USERS: tuple[AclUser, ...] = (
    _service(
        "gateway",
        "%W~meshllm:*:requests",  # SubmitRequest
        "%W~meshllm:*:aborts",  # AbortRequest
        "~meshllm:*:replies:*",  # its own reply stream: read, group ops, trim on exit
        "%R~meshllm:*:grammar:*",  # compiled-grammar cache
        "%R~meshllm:*:heartbeats",  # which worker groups are ready (the mesh view)
        "%R~meshllm:*:kvevents",  # prefix blocks each group holds (KV-aware routing)
        "%W~meshllm:*:calls:grammar",  # CompileGrammar calls (shared.rpc)
        "%R~meshllm:*:rpc:gateway:*",  # their answers (servers write and expire it)
    ),
    _service(
        "scheduler",
        "~meshllm:*:requests",  # consumer group `schedulers`: read, ack, claim
        "~meshllm:*:handoff",  # P/D: prefill schedulers write, decode ones read (`decoders`)
        "%R~meshllm:*:aborts",  # fan-out: plain XREAD
        "%W~meshllm:*:{g*}:steps",  # StepPlan to its worker group
        "~meshllm:*:{g*}:results",  # StepResult: read + group
        "~meshllm:*:{g*}:control",  # WorkerReady: read + group
        "%W~meshllm:*:replies:*",  # TokenDelta to each request's gateway
        "%R~meshllm:*:grammar:*",  # compiled grammars, deserialized in-process
        "~meshllm:*:kvmeta:*",  # offload block metadata
        "%R~meshllm:*:heartbeats",  # worker liveness and incarnation (restart detection)
        "%W~meshllm:*:kvevents",  # KVEvents: prefix blocks stored/removed, for the gateways
        "%W~meshllm:*:calls:kvstore",  # offload tier calls (shared.rpc)
        "%R~meshllm:*:rpc:scheduler:*",  # their answers
    ),
    _service(
        "worker",
        "~meshllm:*:{g*}:steps",  # StepPlan: read + group
        "%W~meshllm:*:{g*}:results",
        "%W~meshllm:*:{g*}:control",
        "~meshllm:*:kv:*",  # offloaded KV payloads: read and write
    ),
    _service(
        "grammar",
        "~meshllm:*:grammar:*",
        "~meshllm:*:calls:grammar",  # its calls: consumer group `servers` (read, ack, claim)
        "%W~meshllm:*:rpc:gateway:*",  # answers (XADD, EXPIRE) to the gateways that call it
    ),
    _service(
        "kvstore",
        "%R~meshllm:*:kv:*",  # payload sizes and existence
        "~meshllm:*:kvmeta:*",
        "~meshllm:*:calls:kvstore",  # its calls: consumer group `servers`
        "%W~meshllm:*:rpc:scheduler:*",  # answers to the schedulers that call it
        # Eviction deletes payloads, but the kvstore never writes one: a selector grants
        # write permission on payload keys to DEL/UNLINK only.
        selectors=("(%W~meshllm:*:kv:* -@all +del +unlink)",),
    ),
)

HEALTHCHECK = AclUser("healthcheck", (), commands="-@all +ping +hello")
"""For container healthchecks (`redis-cli --user healthcheck ... ping`): no key access."""

ADMIN = AclUser("admin", ("~*",), commands="+@all &*")
"""An operator account; rendered only when MESHLLM_REDIS_PASSWORD_ADMIN is set (no default)."""


def password_for(user: AclUser, env: Mapping[str, str]) -> str:
    return env.get(user.password_env) or user.dev_password


def acl_line(user: AclUser, password: str) -> str:
    digest = hashlib.sha256(password.encode()).hexdigest()
    parts = ["user", user.name, "on", f"#{digest}", "resetkeys", "resetchannels"]
    parts += [*user.keys, user.commands, *user.selectors]
    return " ".join(parts)


def render_acl(env: Mapping[str, str] | None = None) -> str:
    """The ACL file text for `env` (default: the process environment)."""
    env = os.environ if env is None else env
    # Redis ACL files allow no comments: the header lives in this module's docstring.
    # `resetpass`, not `nopass`: a default user flagged nopass (even one that is off) keeps
    # protected mode refusing every client that is not on loopback, i.e. every container.
    lines = ["user default off resetpass resetkeys resetchannels -@all"]
    for user in (*SERVICE_USERS, HEALTHCHECK):
        lines.append(acl_line(user, password_for(user, env)))
    admin_password = env.get(ADMIN.password_env)
    if admin_password:
        lines.append(acl_line(ADMIN, admin_password))
    return "\n".join(lines) + "\n"


def redis_url(service: str, host: str, port: int, env: Mapping[str, str], db: int = 0) -> str:
    """The URL a service connects with, authenticated as its own ACL user."""
    user = next(u for u in SERVICE_USERS if u.name == service)
    return f"redis://{user.name}:{password_for(user, env)}@{host}:{port}/{db}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, help="write here (mode 0600) instead of stdout")
    args = parser.parse_args(argv)
    text = render_acl()
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
