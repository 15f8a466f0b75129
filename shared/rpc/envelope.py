"""The envelope rules of a call, free of I/O: correlation ids, reply streams, deadlines.

- A correlation id is unique per client instance and process start (a random prefix, then a
  counter), so a reply meant for a previous incarnation of the same instance id never matches a
  call of this one.
- A reply stream must be `<reply prefix><service>:<instance>` with plain name characters: a
  request cannot make a server write anywhere else (the ACL then narrows each server to the
  reply streams of its own callers).
- A request whose deadline passed is dropped unanswered: its caller gave up, and doing the work
  anyway would only delay the calls still waiting behind it.
"""

from __future__ import annotations

import itertools
import re
import secrets

from shared.protocol import Message, RpcRequest

_NAME = r"[A-Za-z0-9_.\-]{1,200}"
_REPLY_TAIL = re.compile(rf"{_NAME}:{_NAME}")


class CorrelationIds:
    def __init__(self) -> None:
        self._prefix = secrets.token_hex(6)
        self._counter = itertools.count(1)

    def next(self) -> str:
        return f"{self._prefix}-{next(self._counter):x}"


def reply_stream_problem(name: str, reply_prefix: str) -> str | None:
    """Why `name` is not a reply stream under `reply_prefix`, or None when it is one."""
    tail = name[len(reply_prefix) :] if name.startswith(reply_prefix) else None
    if tail is None or not _REPLY_TAIL.fullmatch(tail):
        return f"reply stream {name[:200]!r} is not {reply_prefix}<service>:<instance>"
    return None


def envelope_problem(msg: Message, reply_prefix: str) -> str | None:
    """Why a server must not answer `msg` (it goes to the dead letters), or None."""
    if not isinstance(msg, RpcRequest):
        return f"{msg.TYPE} is not a call"
    if not msg.correlation_id:
        return f"{msg.TYPE} has no correlation id"
    if msg.deadline <= 0:
        return f"{msg.TYPE} has no deadline"
    return reply_stream_problem(msg.reply_stream, reply_prefix)


def expired(deadline: float, now: float) -> bool:
    """Whether the caller of a request with `deadline` has given up by `now` (Unix times)."""
    return now > deadline
