"""Render the Redis ACL file: one user per service, allowed exactly the commands its code runs,
each only on the keys it runs them on.

Passwords come from `MESHLLM_REDIS_PASSWORD_<USER>` (dev defaults below, never real secrets)
and are written as SHA-256 hashes, so the rendered file holds no plain password. The default
user is disabled: a client that does not authenticate can do nothing.

How a user is written. Its root permissions hold no key and only the connection commands
(PING, HELLO, SELECT, CLIENT ID/SETNAME/GETNAME). Every data command comes from a `Grant`, one
Redis 7 ACL selector `(~pattern ... -@all +cmd ...)`: these commands, on these keys, nothing
else. Key permissions alone cannot say "XADD but not DEL" (both write), so a stream a service
only feeds gets a grant of XADD and nothing more. Redis checks a multi-key command against one
selector at a time, so keys one command names together (an XREAD of several streams, an UNLINK
of several keys) must share a grant; the services' commands name one key pattern each.
The commands are the ones the code runs (grep for them before adding one):

- `shared.bus`: XADD (MAXLEN ~ or MINID ~; NOMKSTREAM for notes and calls), EXPIRE (NX on
  reply streams by the scheduler), XREAD + XREVRANGE (fan-out reads; "$" pinned to the newest
  entry), XGROUP CREATE MKSTREAM, XREADGROUP, XPENDING, XAUTOCLAIM, XACK and XDEL of what it
  acked (consumer groups: the consumer empties the stream it reads); the scheduler's intake
  also XCLAIMs (JUSTID) the requests it holds to keep them from idling.
- the gateway keeps its reply stream alive: EXPIRE, XGROUP CREATE MKSTREAM when it is gone.
- key-value: the grammar service GET/SET/EXISTS/EXPIREs compiled grammars, the scheduler GETs
  them; the worker SET/GETs KV payloads; the kvstore HSET/HGETALL/EXISTS/UNLINKs their
  metadata, EXISTS/UNLINKs payloads (evicts them) but never writes one, and SCANs metadata;
  the scheduler HSET/HDEL/HGETs request progress checkpoints (a hash per requests stream).

What no service user can do: list the keyspace (KEYS, RANDOMKEY, DBSIZE, INFO's keyspace
counts; SCAN, except the kvstore below), run anything server-wide (FLUSHALL/FLUSHDB,
CONFIG, DEBUG, SHUTDOWN, SAVE, CLIENT LIST/KILL, MONITOR, ACL, FUNCTION and SCRIPT of any
kind), run scripts (no service uses EVAL/FCALL), or delete, trim, rename, overwrite or expire a
stream it only feeds. Limits of key patterns, which name services, not instances:

- SCAN takes no key, so no pattern confines it: the kvstore, which rebuilds its block table
  from the metadata keys after a restart (`scan_meta`), can list every key name (not values).
  The other users cannot SCAN.
- XADD's MAXLEN argument trims, and an ACL cannot restrict arguments: a user that may append
  to a stream can also cut it short (XADD MAXLEN 0). Every stream is appended to only by the
  services that feed it; nobody else can.
- Heartbeats are one shared stream that every service appends to: a service can append a beat
  that names another instance, even another service. Readers (the gateway's mesh view, the
  scheduler's worker and gateway watches) trust a beat's `service`/`instance_id` fields.
- Reply streams are named per instance (`replies:<gateway id>`, `rpc:<service>:<instance>`) but
  granted per service: a gateway can read, and EXPIRE, another gateway's reply stream, and a
  scheduler can append deltas to any gateway's. A gateway appends to no reply stream at all.

Calls between services (shared.rpc): the caller may only append to the `calls` stream of the
services it calls and read its own service's reply streams; the callee consumes its own
`calls` stream and may only append to (and expire) the reply streams of its callers.
The cluster name is `*` in every pattern, so one ACL file serves any number of clusters.

Run: `python -m infra.redis.render_acl [--out FILE]` (stdout without --out; FILE is written
mode 0600). Used by the `redis-acl` compose service and by the local launcher.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

# Root permissions of every service user: redis-py's connection set-up (HELLO, SELECT, CLIENT
# SETNAME) and PING for readiness. CLIENT SETINFO (Redis >= 7.2) is left out on purpose: naming
# it fails on 7.0, and redis-py ignores its refusal. INFO is left out too: its keyspace section
# counts every database's keys.
CONNECTION = "-@all +ping +hello +select +client|id +client|setname +client|getname"

# Command sets of shared.bus, by role.
APPEND = ("xadd",)
FAN_OUT_READ = ("xread", "xrevrange")
GROUP_CONSUME = ("xgroup|create", "xreadgroup", "xpending", "xautoclaim", "xack", "xdel")
REPLY = ("xadd", "expire")  # a reply stream's writer renews its expiry


@dataclass(frozen=True)
class Grant:
    """`commands` on the keys matching `patterns` (one ACL selector)."""

    patterns: tuple[str, ...]
    commands: tuple[str, ...]

    def selector(self) -> str:
        keys = " ".join(f"~{p}" for p in self.patterns)
        commands = " ".join(f"+{c}" for c in self.commands)
        return f"({keys} -@all {commands})"


def grant(pattern: str, *command_sets: tuple[str, ...]) -> Grant:
    commands = tuple(dict.fromkeys(c for s in command_sets for c in s))
    return Grant((pattern,), commands)


@dataclass(frozen=True)
class AclUser:
    name: str
    grants: tuple[Grant, ...]
    root: str = CONNECTION  # commands allowed without a key (keys only through grants)
    root_keys: tuple[str, ...] = field(default=())

    @property
    def password_env(self) -> str:
        return f"MESHLLM_REDIS_PASSWORD_{self.name.upper()}"

    @property
    def dev_password(self) -> str:
        return f"meshllm-dev-{self.name}"


# Every service beats and dead-letters entries it cannot decode; both streams are write-only.
COMMON = (grant("meshllm:*:deadletter", APPEND),)
BEATS_ONLY = grant("meshllm:*:heartbeats", APPEND)
BEATS_AND_MESH_VIEW = grant("meshllm:*:heartbeats", APPEND, FAN_OUT_READ)


def _service(name: str, *grants: Grant, root: str = CONNECTION) -> AclUser:
    return AclUser(name, (*grants, *COMMON), root)


SERVICE_USERS: tuple[AclUser, ...] = (
    _service(
        "gateway",
        grant("meshllm:*:requests", APPEND),  # SubmitRequest
        grant("meshllm:*:aborts", APPEND),  # AbortRequest
        grant("meshllm:*:calls:grammar", APPEND),  # CompileGrammar calls (shared.rpc)
        # its own reply stream: read, kept alive (EXPIRE; XGROUP CREATE MKSTREAM recreates it)
        grant("meshllm:*:replies:*", FAN_OUT_READ, ("expire", "xgroup|create")),
        grant("meshllm:*:rpc:gateway:*", FAN_OUT_READ),  # grammar answers
        grant("meshllm:*:kvevents", FAN_OUT_READ),  # prefix blocks each group holds (routing)
        BEATS_AND_MESH_VIEW,  # which worker groups are ready
    ),
    _service(
        "scheduler",
        grant("meshllm:*:requests", GROUP_CONSUME, ("xclaim",)),  # group `schedulers`
        # progress checkpoints of the requests read from any requests stream (its own group's,
        # an adopted one's, the shared one): written while running, read when taken over
        grant("meshllm:*:requests:progress", ("hset", "hdel", "hget")),
        # P/D: prefill schedulers append, decode ones consume (group `decoders`)
        grant("meshllm:*:handoff", APPEND, GROUP_CONSUME, ("xclaim",)),
        grant("meshllm:*:aborts", FAN_OUT_READ),
        grant("meshllm:*:{g*}:steps", APPEND),  # StepPlan to its worker group
        grant("meshllm:*:{g*}:results", FAN_OUT_READ),  # StepResult, KVTransferDone
        grant("meshllm:*:{g*}:control", FAN_OUT_READ),  # WorkerReady
        grant("meshllm:*:replies:*", REPLY),  # TokenDelta (EXPIRE NX), NOMKSTREAM notes
        grant("meshllm:*:grammar:*", ("get",)),  # compiled grammars, deserialized in-process
        grant("meshllm:*:kvevents", APPEND),  # KVEvents: blocks stored/removed, for gateways
        grant("meshllm:*:calls:kvstore", APPEND),  # offload tier calls (shared.rpc)
        grant("meshllm:*:rpc:scheduler:*", FAN_OUT_READ),  # their answers
        BEATS_AND_MESH_VIEW,  # worker incarnations, gateways' liveness
    ),
    _service(
        "worker",
        grant("meshllm:*:{g*}:steps", FAN_OUT_READ),
        grant("meshllm:*:{g*}:results", APPEND),
        grant("meshllm:*:{g*}:control", APPEND),
        grant("meshllm:*:kv:*", ("set", "get")),  # offloaded KV payloads
        BEATS_ONLY,
    ),
    _service(
        "grammar",
        grant("meshllm:*:grammar:*", ("get", "set", "exists", "expire")),
        grant("meshllm:*:calls:grammar", GROUP_CONSUME),  # its calls: group `servers`
        grant("meshllm:*:rpc:gateway:*", REPLY),  # answers to the gateways that call it
        BEATS_ONLY,
    ),
    _service(
        "kvstore",
        grant("meshllm:*:kv:*", ("exists", "unlink")),  # evicts payloads, never writes one
        grant("meshllm:*:kvmeta:*", ("hset", "hgetall", "exists", "unlink")),
        grant("meshllm:*:calls:kvstore", GROUP_CONSUME),  # its calls: group `servers`
        grant("meshllm:*:rpc:scheduler:*", REPLY),  # answers to the schedulers that call it
        BEATS_ONLY,
        # SCAN: recovery lists the metadata keys (see the module docstring); MULTI/EXEC:
        # eviction deletes a payload and its metadata together.
        root=f"{CONNECTION} +scan +multi +exec +discard",
    ),
)

HEALTHCHECK = AclUser("healthcheck", (), root="-@all +ping +hello")
"""For container healthchecks (`redis-cli --user healthcheck ... ping`): no key access."""

ADMIN = AclUser("admin", (), root="+@all &*", root_keys=("~*",))
"""An operator account; rendered only when MESHLLM_REDIS_PASSWORD_ADMIN is set (no default)."""


def password_for(user: AclUser, env: Mapping[str, str]) -> str:
    return env.get(user.password_env) or user.dev_password


def acl_line(user: AclUser, password: str) -> str:
    digest = hashlib.sha256(password.encode()).hexdigest()
    parts = ["user", user.name, "on", f"#{digest}", "resetkeys", "resetchannels"]
    parts += [*user.root_keys, user.root, *(g.selector() for g in user.grants)]
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
        # It holds password hashes: owner-only, also when the file existed with a wider mode.
        fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
