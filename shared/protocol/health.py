"""Liveness and capacity announcements on the heartbeat stream."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from shared.kv.groups import KVGroupSpec
from shared.protocol.base import Message, Struct, register

ServiceName = Literal["gateway", "scheduler", "worker", "grammar", "kvstore"]
# What a scheduler does with requests (SchedulerSettings.role); "" = not a scheduler, or a beat
# from before the field existed (such a scheduler serves requests whole).
GroupRole = Literal["", "both", "prefill", "decode"]


class GroupLoad(Struct):
    """A scheduler's load, in its beats: what the gateway's router balances and sheds by, and
    the autoscaling signal (queue depth)."""

    num_waiting: int = Field(0, ge=0)  # requests held but not running (queued, preempted)
    num_running: int = Field(0, ge=0)
    kv_usage: float = Field(0.0, ge=0, le=1)  # fraction of KV blocks held by requests
    max_num_seqs: int = Field(0, ge=0)  # the running batch's bound; 0 = not said


@register
class Heartbeat(Message):
    """Sent periodically by every service. `incarnation` changes on every process start, so a
    restarted worker is recognised as empty (its KV and persistent batch are gone).

    `model`, `role` and `interval_s` were added later with defaults, so beats of older
    processes still decode (the version stays 1): the gateway's mesh view reads them to know
    which worker groups can serve its model, and when a beat is overdue."""

    TYPE = "heartbeat"
    VERSION = 1

    service: ServiceName
    instance_id: str
    incarnation: str
    group: str = "0"
    ready: bool = False
    time: float = 0.0
    model: str = ""  # the served model name; "" for services without a model
    role: GroupRole = ""
    interval_s: float = Field(0.0, ge=0)  # the sender's beat interval; 0 = not said
    load: GroupLoad | None = None  # schedulers only (added later: absent in older beats)


@register
class WorkerReady(Message):
    """A worker announces its model and KV capacity; its scheduler sizes the block pool by it."""

    TYPE = "worker_ready"
    VERSION = 1

    worker_id: str
    incarnation: str
    group: str = "0"
    model: str
    num_kv_blocks: int = Field(ge=1)
    # A hybrid model's state pool (its state groups' block ids index it, null block 0
    # included; services/worker/runner/kv_cache.py). 0 = none: no state group, or a worker from
    # before the state pool, whose state groups share the `num_kv_blocks` ids.
    num_state_blocks: int = Field(0, ge=0)
    block_size: int = Field(ge=1)
    vocab_size: int = Field(ge=1)
    max_model_len: int = Field(ge=1)
    eos_token_ids: list[int] = Field(default_factory=list)
    num_moe_layers: int = 0
    # One entry per KV cache group in shared.kv.groups order; empty = one full-attention group.
    kv_groups: list[KVGroupSpec] = Field(default_factory=list)
    # Bytes of one KV offload chunk payload (one block of one group; 0 = offload off): the
    # scheduler offers stores to the kvstore with it from the first one on.
    kv_chunk_bytes: int = Field(0, ge=0)
    time: float = 0.0

    @model_validator(mode="after")
    def _state_pool_holds_a_block(self) -> WorkerReady:
        # (That a state pool comes with a state group is the scheduler config's check.)
        if self.num_state_blocks == 1:
            raise ValueError("num_state_blocks is 0 or at least 2 (1 is the null block)")
        return self
