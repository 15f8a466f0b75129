"""The msgpack codec: every registered message survives a round trip; bad bytes get a reason."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from shared.codec import CodecError, decode, encode
from shared.kv.groups import Ring, kv_groups_for
from shared.protocol import (
    MESSAGE_TYPES,
    AbortRequest,
    CachedRequestData,
    CompileGrammar,
    GrammarCompiled,
    GrammarRef,
    Heartbeat,
    KVChunkOffers,
    KVChunks,
    KVChunksAt,
    KVCountReply,
    KVEvents,
    KVFinishedReply,
    KVLoad,
    KVLoaded,
    KVLoadReply,
    KVLookup,
    KVLookupReply,
    KVRequestFinished,
    KVStats,
    KVStatsReply,
    KVStore,
    KVStored,
    KVStoreReply,
    KVTransfer,
    KVTransferDone,
    KVWriting,
    Message,
    NewRequestData,
    Ping,
    Pong,
    ProgressCheckpoint,
    RequestDelta,
    RpcErrorReply,
    SampledTokens,
    SamplingParams,
    StepPlan,
    StepResult,
    SubmitRequest,
    TokenDelta,
    WorkerReady,
)
from shared.protocol.health import GroupLoad

INT32_EDGES = [0, 1, -1, 2**31 - 1, -(2**31), 49151]


def sampling() -> SamplingParams:
    return SamplingParams(
        temperature=0.7,
        top_p=0.9,
        top_k=50,
        min_p=0.05,
        seed=2**64 - 1,
        max_tokens=128,
        min_tokens=2,
        stop_token_ids=[2, 7],
        ignore_eos=True,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.1,
        logit_bias={5: -100.0, 49151: 2.5},
        allowed_token_ids=[1, 2, 3],
        bad_token_ids=[9],
        bad_words_token_ids=[[4, 8], [6]],
        logprobs=5,
        prompt_logprobs=2,
    )


# Calls between services (shared.rpc): the envelope, then the grammar and kvstore calls.
CALL = {
    "correlation_id": "c0ffee-1",
    "reply_stream": "meshllm:c:rpc:gateway:gw-1",
    "deadline": 12.5,
}
ANSWER = {"correlation_id": "c0ffee-1"}
SPACE = {"model": "SmolLM2-135M-Instruct", "layout_version": 2}
CHUNKS = KVChunks(hashes=bytes(range(32)), groups=[0, 1])
CHUNKS_AT = KVChunksAt(hashes=bytes(range(32)), groups=[0, 1], ends=[16, 32])
OFFERS = KVChunkOffers(hashes=bytes(range(32)), groups=[0, 1], ends=[16, 32], nbytes=[1, 2**40])
RPC_SAMPLES: list[Message] = [
    Ping(**CALL),
    Pong(**ANSWER, service="kvstore", instance_id="kv-1"),
    RpcErrorReply(**ANSWER, kind="bad_request", message="unsupported JSON schema keyword"),
    CompileGrammar(**CALL, kind="regex", spec="[0-9]+"),
    GrammarCompiled(
        **ANSWER,
        key="ab" * 32,
        kind="json_schema",
        source="compiled",
        compiled_bytes=60_000,
        compile_seconds=0.0045,
        tokenizer_hash="t0k",
        xgrammar_version="0.2.9",
    ),
    KVLookup(**CALL, **SPACE, chunks=CHUNKS),
    KVStore(**CALL, **SPACE, request_id="req-1", chunks=OFFERS),
    KVWriting(**CALL, **SPACE, chunks=CHUNKS),
    KVStored(**CALL, **SPACE, chunks=OFFERS, ok=False),
    KVLoad(**CALL, **SPACE, holder="req-1", internal=True, chunks=CHUNKS_AT),
    KVLoaded(**CALL, **SPACE, holder="req-1", chunks=CHUNKS),
    KVRequestFinished(**CALL, request_id="req-1"),
    KVStats(**CALL),
    KVLookupReply(**ANSWER, statuses=[0, 1, 2, 3]),
    KVStoreReply(**ANSWER, outcomes=[0, 1, 2], evicted=3),
    KVLoadReply(**ANSWER, pinned=[1, 0]),
    KVCountReply(**ANSWER, count=5),
    KVFinishedReply(**ANSWER, keys=4, inserted=1, reused=2, store_misses=1),
    KVStatsReply(
        **ANSWER,
        chunks=9,
        used_bytes=900,
        capacity_bytes=1000,
        writing=1,
        ready=6,
        pinned=2,
        evictions=3,
        requests=4,
        pin_holders=2,
        recovered=5,
        undeleted=1,
    ),
]

# One fully populated instance per message type: every field, nested ones included, differs
# from its default, so a field the codec drops or mangles cannot hide behind a default.
SAMPLES: dict[str, Message] = {
    m.TYPE: m
    for m in [
        SubmitRequest(
            request_id="req-1",
            prompt_token_ids=INT32_EDGES,
            sampling=sampling(),
            reply_stream="meshllm:default:replies:gw-1",
            arrival_time=1_700_000_000.25,
            grammar=GrammarRef(kind="json_schema", spec='{"type": "object"}', key="k1"),
            return_routed_experts=True,
            routed_experts_prompt_start=3,
            cache_salt="salt",
            priority=-3,
        ),
        AbortRequest(request_id="req-1", reason="timeout"),
        StepPlan(
            step_id=2**40,
            scheduler_id="sched-a",
            worker_incarnation="inc-1",
            scheduler_incarnation="sched-inc-7",
            new_requests=[
                NewRequestData(
                    request_id="req-1",
                    token_ids=[11, 12, 13, 14],
                    num_prompt_tokens=3,
                    block_ids=[[1, 2], [3]],
                    num_computed_tokens=2,
                    sampling=sampling(),
                    return_routed_experts=True,
                )
            ],
            cached_requests=[
                CachedRequestData(
                    request_id="req-2", new_block_ids=[[4], []], num_computed_tokens=17
                )
            ],
            num_scheduled_tokens={"req-1": 2, "req-2": 1},
            finished_request_ids=["req-3"],
            preempted_request_ids=["req-4"],
            grammar_request_ids=["req-1"],
            grammar_bitmask=np.array([-1, 0x0F0F0F0F], dtype="<i4").tobytes(),
            kv_stores=[
                KVTransfer(
                    transfer_id="s-1", request_id="req-1", keys=["k1"], groups=[0], block_ids=[1]
                )
            ],
            kv_loads=[
                KVTransfer(
                    transfer_id="l-1",
                    request_id="req-5",
                    keys=["k2", "k3"],
                    groups=[0, 1],
                    block_ids=[5, 6],
                )
            ],
            spec_token_ids={"req-2": [7, 8, 9]},
            spec_lookahead={"req-1": 4},
        ),
        KVTransferDone(
            worker_id="worker-0",
            worker_incarnation="inc-1",
            transfer_id="l-1",
            request_id="req-5",
            kind="store",
            ok=False,
            failed_keys=["k3"],
            num_bytes=4096,
            seconds=0.25,
            error="redis down",
        ),
        StepResult(
            step_id=7,
            worker_id="worker-0",
            worker_incarnation="inc-1",
            sampled=[
                SampledTokens(
                    request_id="req-1",
                    token_ids=[42, 43],
                    logprobs=[-0.5, -1.25],
                    top_token_ids=[42, 7, 43, 8],
                    top_logprobs=[-0.5, -2.0, -1.25, -3.0],
                    routed_experts=[0, 3, 1, 2],
                    routed_experts_shape=[2, 1, 2],
                    prompt_logprobs_start=3,
                    prompt_logprobs=[-1.5],
                    prompt_top_token_ids=[9],
                    prompt_top_logprobs=[-0.25],
                    prompt_ranks=[4],
                    draft_token_ids=[44, 45],
                    num_drafts=3,
                )
            ],
            error="cuda oom",
            execute_ms=3.5,
        ),
        TokenDelta(
            scheduler_id="sched-a",
            deltas=[
                RequestDelta(
                    request_id="req-1",
                    start_index=4,
                    token_ids=[42],
                    logprobs=[-0.5],
                    top_token_ids=[42, 7],
                    top_logprobs=[-0.5, -2.0],
                    routed_experts=[5, 6],
                    routed_experts_shape=[1, 1, 2],
                    prompt_logprobs=[-1.5, -0.75],
                    prompt_top_token_ids=[9, 10],
                    prompt_top_logprobs=[-0.25, -0.5],
                    prompt_ranks=[2, 1],
                    finish_reason="stop",
                    stop_token_id=2,
                    num_prompt_tokens=6,
                    num_cached_tokens=4,
                    error="none",
                    error_type="invalid_request_error",
                )
            ],
        ),
        ProgressCheckpoint(
            request_id="req-1",
            num_prompt_tokens=6,
            output_token_ids=[42, 7, 9],
            scheduler_id="sched-1",
            incarnation="inc-1",
        ),
        Heartbeat(
            service="worker",
            instance_id="host-1",
            incarnation="inc-1",
            group="1",
            ready=True,
            time=12.5,
            model="SmolLM2-135M-Instruct",
            role="prefill",
            interval_s=0.5,
            load=GroupLoad(num_waiting=3, num_running=5, kv_usage=0.25, max_num_seqs=64),
        ),
        KVEvents(
            group="1",
            scheduler_id="scheduler-1",
            incarnation="inc-1",
            block_size=16,
            snapshot=True,
            stored=b"\x01" * 32,
            removed=b"\x02" * 16,
            time=12.5,
        ),
        WorkerReady(
            worker_id="worker-0",
            incarnation="inc-1",
            group="1",
            model="SmolLM2-135M-Instruct",
            num_kv_blocks=1024,
            block_size=16,
            vocab_size=49152,
            max_model_len=8192,
            eos_token_ids=[2],
            num_moe_layers=4,
            num_state_blocks=97,
            kv_groups=kv_groups_for([8, 4, 8, Ring(16)]),  # sliding and ring: every field set
            kv_chunk_bytes=737_344,
            time=12.5,
        ),
        *RPC_SAMPLES,
    ]
}


def fields_left_default(model: BaseModel, path: str = "") -> list[str]:
    """Dotted paths of fields (recursively) whose value equals the field's default. In a list
    of models a field counts as populated when any item sets it (kind-exclusive fields such
    as a KV group's `sliding_window` and `ring_size` cannot both be set in one item)."""
    left = []
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        default = info.get_default(call_default_factory=True)
        if default is not PydanticUndefined and value == default:
            left.append(path + name)
        items = [
            v for v in (value if isinstance(value, list) else [value]) if isinstance(v, BaseModel)
        ]
        if items:
            per_item = [set(fields_left_default(item, f"{path}{name}[].")) for item in items]
            left += sorted(set.intersection(*per_item))
    return left


def envelope(type_tag: Any, version: Any, body: Any) -> bytes:
    return msgpack.packb({"t": type_tag, "v": version, "b": body}, use_bin_type=True)


def reason_of(data: Any, **kwargs: Any) -> CodecError:
    with pytest.raises(CodecError) as caught:
        decode(data, **kwargs)
    return caught.value


def test_every_registered_type_has_a_fully_populated_sample() -> None:
    assert set(SAMPLES) == set(MESSAGE_TYPES)
    for sample in SAMPLES.values():
        assert fields_left_default(sample) == [], type(sample).__name__


@pytest.mark.parametrize("type_tag", sorted(MESSAGE_TYPES))
def test_round_trip(type_tag: str) -> None:
    sample = SAMPLES[type_tag]
    data = encode(sample)
    assert decode(data) == sample
    assert decode(data, expected=type(sample)) == sample
    assert type(decode(data)) is MESSAGE_TYPES[type_tag]


def test_packed_fields_travel_as_little_endian_bytes() -> None:
    body = msgpack.unpackb(encode(SAMPLES["submit"]), raw=False, strict_map_key=False)["b"]
    assert body["prompt_token_ids"] == np.array(INT32_EDGES, dtype="<i4").tobytes()
    assert body["sampling"]["seed"] == 2**64 - 1
    assert body["sampling"]["logit_bias"] == {5: -100.0, 49151: 2.5}  # int keys on the wire
    step = msgpack.unpackb(encode(SAMPLES["step_plan"]), raw=False, strict_map_key=False)["b"]
    assert step["new_requests"][0]["block_ids"] == [
        np.array([1, 2], "<i4").tobytes(),
        np.array([3], "<i4").tobytes(),
    ]


def test_defaults_are_left_out_and_restored() -> None:
    minimal = AbortRequest(request_id="r")
    body = msgpack.unpackb(encode(minimal), raw=False)["b"]
    assert body == {"request_id": "r"}
    assert decode(encode(minimal)) == minimal


def test_a_heartbeat_from_before_model_role_and_interval_still_decodes() -> None:
    old = {"service": "scheduler", "instance_id": "s", "incarnation": "i", "ready": True}
    beat = decode(envelope("heartbeat", 1, old), expected=Heartbeat)
    assert (beat.model, beat.role, beat.interval_s, beat.ready) == ("", "", 0.0, True)


def test_rejects_bytes_that_are_not_msgpack() -> None:
    assert reason_of(b"\xc1\x00\x01").reason == "malformed"


def test_rejects_a_truncated_encoding() -> None:
    data = encode(SAMPLES["submit"])
    for cut in (1, len(data) // 2, len(data) - 1):
        assert reason_of(data[:cut]).reason == "malformed", cut


def test_rejects_oversized_input() -> None:
    data = encode(SAMPLES["abort"])
    error = reason_of(data, max_bytes=len(data) - 1)
    assert error.reason == "oversized"
    assert decode(data, max_bytes=len(data)) == SAMPLES["abort"]


def test_rejects_a_wrong_version() -> None:
    error = reason_of(envelope("abort", AbortRequest.VERSION + 1, {"request_id": "r"}))
    assert error.reason == "bad_version"


def test_rejects_an_unknown_type() -> None:
    assert reason_of(envelope("teleport", 1, {})).reason == "unknown_type"
    assert reason_of(envelope(7, 1, {})).reason == "unknown_type"


def test_rejects_a_type_other_than_expected() -> None:
    error = reason_of(encode(SAMPLES["abort"]), expected=SubmitRequest)
    assert error.reason == "unexpected_type"


def test_rejects_extra_fields() -> None:
    error = reason_of(envelope("abort", 1, {"request_id": "r", "priority": 9}))
    assert error.reason == "invalid"
    assert "priority" in error.detail


def test_rejects_extra_fields_in_nested_models() -> None:
    body = msgpack.unpackb(encode(SAMPLES["submit"]), raw=False, strict_map_key=False)["b"]
    body["sampling"]["beam_width"] = 4
    error = reason_of(envelope("submit", 1, body))
    assert error.reason == "invalid"
    assert "sampling.beam_width" in error.detail


def test_rejects_packed_ints_whose_length_is_not_a_multiple_of_four() -> None:
    body = {"request_id": "r", "prompt_token_ids": b"\x01\x00\x00\x00\x02", "reply_stream": "s"}
    error = reason_of(envelope("submit", 1, body))
    assert error.reason == "invalid"
    assert "prompt_token_ids" in error.detail
    assert "multiple of 4" in error.detail


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("prompt_token_ids", [1, 2**40]),  # msgpack carries it; packing a StepPlan would not
        ("prompt_token_ids", [-(2**31) - 1]),
        ("sampling", {"max_tokens": 2**40}),
        ("sampling", {"top_k": 2**31}),
        ("sampling", {"stop_token_ids": [2**31]}),
        ("sampling", {"logit_bias": {2**33: 1.0}}),
        ("reply_stream", "r" * 513),
    ],
)
def test_rejects_values_that_do_not_fit_their_wire_types(field: str, value: object) -> None:
    body: dict[str, object] = {"request_id": "r", "prompt_token_ids": [1], "reply_stream": "s"}
    body[field] = value
    error = reason_of(envelope("submit", 1, body))
    assert error.reason == "invalid"
    assert field in error.detail


def test_int32_bounds_are_inclusive() -> None:
    ids = [-(2**31), 2**31 - 1]
    msg = SubmitRequest(request_id="r", prompt_token_ids=ids, reply_stream="s")
    assert decode(encode(msg)).prompt_token_ids == ids  # type: ignore[attr-defined]
    assert SubmitRequest(request_id="r", prompt_token_ids=np.array(ids), reply_stream="s")
    with pytest.raises(ValueError, match="int32"):
        SubmitRequest(request_id="r", prompt_token_ids=np.array([2**32]), reply_stream="s")


@pytest.mark.parametrize(
    ("ids", "kept"),
    [
        ([3, 1, 2], [3, 1, 2]),  # plain ints: the fast path, order kept
        ((3, 1), [3, 1]),
        ([3, 2.0], [3, 2]),  # an integral float among ints: the checked path
        ([np.int64(5), 1], [5, 1]),
    ],
)
def test_packed_int_lists_are_taken_as_ints(ids: Any, kept: list[int]) -> None:
    msg = SubmitRequest(request_id="r", prompt_token_ids=ids, reply_stream="s")
    assert msg.prompt_token_ids == kept
    assert all(type(t) is int for t in msg.prompt_token_ids)


@pytest.mark.parametrize("ids", [[1, True], [1, 2.5], [1, "2"], [None]])
def test_packed_int_lists_refuse_what_is_not_an_int(ids: list[Any]) -> None:
    with pytest.raises(ValueError, match="int items"):
        SubmitRequest(request_id="r", prompt_token_ids=ids, reply_stream="s")


def test_rejects_a_body_that_breaks_the_schema() -> None:
    error = reason_of(envelope("submit", 1, {"request_id": "r", "reply_stream": "s"}))
    assert error.reason == "invalid"
    assert "prompt_token_ids" in error.detail


def test_rejects_a_bad_envelope() -> None:
    assert reason_of(msgpack.packb([1, 2, 3])).reason == "bad_envelope"
    assert reason_of(msgpack.packb({"t": "abort", "v": 1})).reason == "bad_envelope"
    assert reason_of(envelope("abort", 1, ["r"])).reason == "bad_envelope"


def test_rejects_input_that_is_not_bytes() -> None:
    assert reason_of("not bytes").reason == "not_bytes"
