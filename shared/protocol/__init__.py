"""The bus protocol: every message type, defined once and imported by every service."""

from shared.protocol.base import MESSAGE_TYPES, Message, Struct, register
from shared.protocol.grammar import CompileGrammar, GrammarCompiled
from shared.protocol.health import Heartbeat, WorkerReady
from shared.protocol.kv_events import KVEvents
from shared.protocol.kv_transfer import KVTransfer, KVTransferDone
from shared.protocol.kvstore import (
    KVChunkOffers,
    KVChunks,
    KVChunksAt,
    KVCountReply,
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
    KVWriting,
)
from shared.protocol.packed import Blob, PackedFloat32, PackedInt32, PackedInt64, PackedUInt8
from shared.protocol.progress import ProgressCheckpoint
from shared.protocol.replies import FinishReason, RequestDelta, TokenDelta
from shared.protocol.requests import (
    AbortRequest,
    GrammarKind,
    GrammarRef,
    SamplingParams,
    SubmitRequest,
)
from shared.protocol.rpc import ErrorKind, Ping, Pong, RpcErrorReply, RpcReply, RpcRequest
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
    "CompileGrammar",
    "ErrorKind",
    "FinishReason",
    "GrammarCompiled",
    "GrammarKind",
    "GrammarRef",
    "Heartbeat",
    "KVChunkOffers",
    "KVChunks",
    "KVChunksAt",
    "KVCountReply",
    "KVEvents",
    "KVFinishedReply",
    "KVLoad",
    "KVLoadReply",
    "KVLoaded",
    "KVLookup",
    "KVLookupReply",
    "KVRequestFinished",
    "KVStats",
    "KVStatsReply",
    "KVStore",
    "KVStoreReply",
    "KVStored",
    "KVTransfer",
    "KVTransferDone",
    "KVWriting",
    "Message",
    "NewRequestData",
    "PackedFloat32",
    "PackedInt32",
    "PackedInt64",
    "PackedUInt8",
    "Ping",
    "Pong",
    "ProgressCheckpoint",
    "RequestDelta",
    "RpcErrorReply",
    "RpcReply",
    "RpcRequest",
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
