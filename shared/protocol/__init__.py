"""The bus protocol: every message type, defined once and imported by every service."""

from shared.protocol.base import MESSAGE_TYPES, Message, Struct, register
from shared.protocol.health import Heartbeat, WorkerReady
from shared.protocol.kv_transfer import KVTransfer, KVTransferDone
from shared.protocol.packed import Blob, PackedFloat32, PackedInt32
from shared.protocol.replies import FinishReason, RequestDelta, TokenDelta
from shared.protocol.requests import AbortRequest, GrammarRef, SamplingParams, SubmitRequest
from shared.protocol.steps import (
    CachedRequestData,
    NewRequestData,
    SampledTokens,
    StepPlan,
    StepResult,
)

__all__ = [
    "MESSAGE_TYPES",
    "AbortRequest",
    "Blob",
    "CachedRequestData",
    "FinishReason",
    "GrammarRef",
    "Heartbeat",
    "KVTransfer",
    "KVTransferDone",
    "Message",
    "NewRequestData",
    "PackedFloat32",
    "PackedInt32",
    "RequestDelta",
    "SampledTokens",
    "SamplingParams",
    "StepPlan",
    "StepResult",
    "Struct",
    "SubmitRequest",
    "TokenDelta",
    "WorkerReady",
    "register",
]
