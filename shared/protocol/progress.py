"""Scheduler -> scheduler, through a Redis hash: how far a running request has got.

A scheduler checkpoints the output tokens of the requests it runs (services/scheduler/progress),
so that one adopting a request after a fault (a dead group's, or its own before a restart)
continues from there instead of from the prompt. Not a stream message: it is the value of one
field (the request id) of the progress hash of the request's stream (Streams.progress).
"""

from __future__ import annotations

from pydantic import Field

from shared.protocol.base import Message, register
from shared.protocol.packed import PackedInt32


@register
class ProgressCheckpoint(Message):
    """`output_token_ids`: the request's first outputs, every one of them already published to
    its reply stream when this was written (so a resume at their end loses none).
    `num_prompt_tokens` guards against a checkpoint of another request under the same id.
    `scheduler_id` / `incarnation`: who wrote it (for logs)."""

    TYPE = "progress"
    VERSION = 1

    request_id: str = Field(min_length=1, max_length=256)
    num_prompt_tokens: int = Field(ge=1)
    output_token_ids: PackedInt32 = Field(default_factory=list)
    scheduler_id: str = ""
    incarnation: str = ""
