"""Progress checkpoints through the rendered ACL: a scheduler writes its running requests'
checkpoints (one pipelined round, only when due), another scheduler reads one when it takes
the entry over and resumes from it, and the field is deleted once the request finishes. Only
schedulers touch the hash, and only with the commands they run."""

from __future__ import annotations

import pytest
from redis.exceptions import NoPermissionError

from services.scheduler.config import SchedulerConfig
from services.scheduler.progress_edge import ProgressEdge
from services.scheduler.scheduler import Scheduler
from shared.bus import Bus, Delivery
from shared.config import SchedulerSettings
from shared.protocol import SampledTokens, SamplingParams, StepResult, SubmitRequest
from tests.integration.test_acl import S, acl_redis, bus_as, raw  # noqa: F401 - fixtures
from tests.support.redis_server import RedisServer


def settings(instance: str) -> SchedulerSettings:
    return SchedulerSettings(
        cluster="acl", group="1", instance_id=instance, progress_checkpoint_s=1.0, role="both"
    )


def core() -> Scheduler:
    return Scheduler(SchedulerConfig(block_size=4, num_gpu_blocks=32, vocab_size=1000), "s")


def step(core: Scheduler, rid: str, token: int) -> None:
    plan = core.schedule()
    assert plan is not None
    sampled = [SampledTokens(request_id=rid, token_ids=[token])]
    core.update_from_output(plan, StepResult(step_id=plan.step_id, worker_id="w", sampled=sampled))


async def test_checkpoints_are_written_read_back_and_deleted(bus_as: dict[str, Bus]) -> None:  # noqa: F811
    redis = bus_as["scheduler"].redis
    msg = SubmitRequest(
        request_id="r1",
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingParams(max_tokens=8),
        reply_stream=S.replies("gw"),
    )
    delivery = Delivery(S.group_requests("7"), "1-0", msg, deliveries=2)  # a peer's entry
    first, first_edge = core(), ProgressEdge(redis, S, settings("s-1"), "inc-1")
    first.add_request(msg)
    held = {"r1": (msg, delivery)}
    await first_edge.sync(first, held, now=0.0)  # no output yet: nothing to write
    assert await first_edge.read(delivery) is None
    step(first, "r1", 11)
    step(first, "r1", 12)
    await first_edge.sync(first, held, now=0.5)  # not due yet
    assert await first_edge.read(delivery) is None
    await first_edge.sync(first, held, now=1.0)
    checkpoint = await first_edge.read(delivery)
    assert checkpoint is not None and list(checkpoint.output_token_ids) == [11, 12]
    assert (checkpoint.num_prompt_tokens, checkpoint.incarnation) == (3, "inc-1")
    key = "meshllm:acl:{g7}:requests:progress"  # the hash of the entry's stream (group 7)
    assert S.progress(delivery.stream) == key and await redis.hget(key, "r1") is not None

    # Another scheduler takes the entry over: it resumes after the two tokens.
    second, second_edge = core(), ProgressEdge(redis, S, settings("s-2"), "inc-2")
    assert second.add_request(msg, checkpoint=checkpoint) is None
    second_edge.note_added(second, delivery, checkpoint)
    request = second.get_request("r1")
    assert request is not None and request.output_token_ids == [11, 12]
    assert second_edge.num_resumed == 1
    await second_edge.sync(second, held, now=0.0)  # nothing grew: not rewritten
    second_edge.book.finished("r1")  # finished and acked (Intake.forget)
    await second_edge.sync(second, {}, now=1.0)
    assert await second_edge.read(delivery) is None


async def test_a_checkpoint_that_does_not_decode_is_ignored(bus_as: dict[str, Bus]) -> None:  # noqa: F811
    redis = bus_as["scheduler"].redis
    msg = SubmitRequest(request_id="r2", prompt_token_ids=[1], reply_stream=S.replies("gw"))
    delivery = Delivery(S.requests, "1-0", msg, deliveries=3)
    await redis.hset(S.progress(S.requests), "r2", b"\x93not a checkpoint")
    assert await ProgressEdge(redis, S, settings("s-3"), "inc").read(delivery) is None


def test_only_schedulers_touch_checkpoints(acl_redis: RedisServer) -> None:  # noqa: F811
    key = S.progress(S.group_requests("1"))
    scheduler = raw(acl_redis, "scheduler")
    scheduler.hset(key, "r", b"x")
    assert scheduler.hget(key, "r") == b"x"
    for name in ("gateway", "worker", "kvstore", "grammar"):
        with pytest.raises(NoPermissionError):
            raw(acl_redis, name).hget(key, "r")
    for command in (("DEL", key), ("HGETALL", key), ("EXPIRE", key, "1"), ("GET", key)):
        with pytest.raises(NoPermissionError):  # exactly HSET/HDEL/HGET
            scheduler.execute_command(*command)
    assert scheduler.hdel(key, "r") == 1
