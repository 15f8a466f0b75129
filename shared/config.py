"""Service configuration from `MESHLLM_*` environment variables (pydantic-settings).

One settings class per service, all sharing `CommonSettings`. The same variable names appear in
docker-compose.yml and are read by the local launcher, so the compose file is the single place
where a deployment's configuration is written down.

Any setting can also come from a file: `MESHLLM_<FIELD>_FILE=/run/secrets/x` (Docker and
Kubernetes secrets; shared/setting_files.py). The Redis password has a field of its own,
`redis_password`, so a secret holds just the password and the URL stays in plain config.
"""

from __future__ import annotations

import os
import socket
from typing import Literal
from urllib.parse import quote, urlsplit, urlunsplit

from pydantic import Field, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from shared.setting_files import FileSettingsSource

#: vLLM's --scheduling-policy (SchedulingSettings.scheduling_policy).
SchedulingPolicy = Literal["fcfs", "priority"]


class MeshSettings(BaseSettings):
    """`MESHLLM_*` variables, and `MESHLLM_*_FILE` files (which rank above the variables)."""

    model_config = SettingsConfigDict(env_prefix="MESHLLM_", extra="ignore")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        files = FileSettingsSource(settings_cls)
        return (init_settings, files, env_settings, dotenv_settings, file_secret_settings)


def with_password(url: str, password: str) -> str:
    """`url` with its password replaced (percent-encoded, so any character is allowed)."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    user = quote(parts.username or "", safe="")
    return urlunsplit(parts._replace(netloc=f"{user}:{quote(password, safe='')}@{host}"))


class CommonSettings(MeshSettings):
    redis_url: str = "redis://127.0.0.1:6379/0"
    # Replaces the password in redis_url when set: a secret file then holds only the password
    # (MESHLLM_REDIS_PASSWORD_FILE), and it may contain characters a URL cannot.
    redis_password: str = ""
    cluster: str = "default"
    # Names this instance: its consumer in stream groups (with the service and group), so it
    # must survive a restart for the restarted process to resume its own pending entries at
    # once. The host name is a container's or pod's own and stays across its restarts; the
    # local launcher sets the compose service name.
    instance_id: str = Field(default_factory=socket.gethostname)
    group: str = "0"  # worker group served by a scheduler / worker
    host: str = "0.0.0.0"
    port: int = 0
    admin_token: str = ""  # empty = admin actions disabled
    log_level: str = "INFO"
    log_json: bool = True
    stream_maxlen: int = 100_000  # approximate MAXLEN of streams read through a group
    # History kept in fan-out streams (steps, results, kvevents, heartbeats, replies, ...:
    # shared/streams.py trimmed_by_age): more than any reader lags or replays on start (30 s).
    # Their bytes are rate x retention: at 600 s the steps stream alone held 62 MiB on the
    # 2-core CPU soak (5 KB plans), and a GPU makes ten times the steps.
    stream_retention_s: float = Field(60.0, ge=60)
    claim_idle_ms: int = 15_000  # pending entries idle this long are claimed from dead consumers
    # An entry delivered more often than this (its consumers kept dying on it) is dead-lettered
    # and its request failed, instead of taking every consumer that reads it down in turn.
    max_deliveries: int = Field(5, ge=1)
    redis_timeout_s: float = Field(5.0, gt=0)  # one Redis command; a dead connection past it
    # A publish on a request's path (the gateway's submit) gives up after this and answers 503;
    # a service's own loops wait for Redis however long it is away.
    publish_timeout_s: float = Field(30.0, gt=0)
    heartbeat_interval_s: float = 1.0
    # Freed heap glibc holds is handed back to the OS this often (shared/heap_trim.py; 0 = never).
    malloc_trim_interval_s: float = Field(60.0, ge=0)
    shutdown_timeout_s: float = 30.0
    # The service's event loop and HTTP parser: uvloop and httptools (as uvicorn[standard] and
    # vLLM's API server run), or the standard library's asyncio and h11 (pure Python).
    event_loop: Literal["uvloop", "asyncio"] = "uvloop"
    # A gateway's reply stream expires this long after the gateway last refreshed it (every
    # heartbeat): a dead gateway's stream disappears, a live one's never does. Schedulers give
    # the same expiry to a reply stream they re-create by writing to it after it expired.
    reply_stream_ttl_s: int = Field(120, ge=2)

    @model_validator(mode="after")
    def _password_into_url(self) -> CommonSettings:
        if self.redis_password:
            self.redis_url = with_password(self.redis_url, self.redis_password)
        return self


class ModelSettings(MeshSettings):
    model: str = ""  # HF safetensors dir or .gguf file; empty = embedded SmolLM2-135M-Instruct
    served_model_name: str = ""  # name in the OpenAI API; default derived from `model`
    model_cache_dir: str = Field(
        default_factory=lambda: (
            os.path.expanduser(os.environ.get("XDG_CACHE_HOME", "~/.cache")) + "/meshllm"
        )
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_model_len: int = 0  # 0 = the model's own context length
    block_size: int = 16


class SchedulingSettings(MeshSettings):
    """Read by the scheduler, which applies the policy, and by the gateway, which refuses a
    request `priority` the policy would refuse before anything is queued or streamed."""

    # vLLM's --scheduling-policy: "fcfs" serves requests in arrival order and refuses a request
    # priority other than 0; "priority" serves the lowest SubmitRequest.priority first (arrival
    # breaking ties) and preempts the least urgent running request (services/scheduler/
    # waiting_queue.py).
    scheduling_policy: SchedulingPolicy = "fcfs"


class GatewaySettings(CommonSettings, ModelSettings, SchedulingSettings):
    port: int = 8000
    api_keys: str = ""  # comma-separated; empty = no auth on /v1
    max_pending_requests: int = 256  # past this, 429
    max_n: int = 16
    max_logprobs: int = 20
    request_timeout_s: float = 600.0
    # No reply delta (token) for a request this long, from its acceptance on: it ends with a
    # 504 / error event and is aborted (services/gateway/stream/request_deadline.py). 0: off.
    progress_timeout_s: float = Field(120.0, ge=0)
    # A compile call to the grammar service, over the bus (cached: ms; new: up to its limit).
    grammar_timeout_s: float = Field(30.0, gt=0)
    # Request bodies past this size are refused with 413 before they are read (Content-Length)
    # or as soon as a streamed body passes it. 32 MiB holds a million-token prompt as text or
    # as token ids with room to spare; OpenAI's own cap on a request is of the same order.
    max_body_bytes: int = Field(32 * 2**20, ge=1)
    # JSON arrays/objects nested deeper than this anywhere in a body (or in a JSON spec sent as
    # a string, e.g. structured_outputs.json) are a 400, checked on the raw bytes before
    # parsing. Chat bodies nest < 10 levels; OpenAI caps structured-output schemas at 10 levels
    # of objects, ~50 JSON levels in their deepest realistic form (arrays of nullable objects).
    max_json_depth: int = Field(64, ge=1)
    # Processes that parse and tokenize bodies of 4 KiB or more (services/gateway/plan/
    # planning_pool.py), so a large body never blocks the event loop. Each holds a tokenizer.
    planning_processes: int = Field(2, ge=1)
    # Gateway processes serving the API on its one port, as vLLM's --api-server-count: each a
    # whole gateway (its own reply stream, planning processes and mesh view) taking the
    # connections the kernel hands it; /metrics sums them (services/gateway/api_processes.py).
    api_processes: int = Field(1, ge=1)
    # Routing among worker groups (services/gateway/route): "kv" weighs each group's cached
    # prefix of the prompt against its load, "least_load" takes the least loaded group,
    # "round_robin" takes them in turn.
    router_policy: Literal["kv", "least_load", "round_robin"] = "kv"
    # kv: what a whole prompt's cache hit is worth against load, in requests running or queued
    # (Dynamo's --kv-overlap-score-weight); 0 = load only. See services/gateway/route/router.py.
    # 4: at 1 (Dynamo's default) one request of load outweighs a whole cached prompt, and on
    # prefix-heavy traffic the router then did no better than round robin (bench/RESULTS.md).
    kv_overlap_score_weight: float = Field(4.0, ge=0)
    # kv: when the group the cost picks holds at least this many times (1 + the least load)
    # requests, the least loaded groups compete instead (SGLang's balance thresholds): a prefix
    # cached on one group never keeps another idle while it runs two or more. 0 = off.
    kv_balance_ratio: float = Field(2.0, ge=0)
    # Load shedding: a group with this many requests queued (waiting, by its last beat, plus
    # those routed to it since) takes no more; with every group full, or this many queued in
    # all, a request gets 429 + Retry-After. 0 = no bound.
    max_queued_per_group: int = Field(256, ge=0)
    max_queued_total: int = Field(0, ge=0)
    # The model's tool-call format, for tool_choice "auto" (vLLM's --tool-call-parser): "hermes"
    # reads <tool_call>{"name": ..., "arguments": ...}</tool_call> (Qwen2.5/Qwen3, Hermes),
    # "llama3_json" an output of {"name": ..., "parameters": ...} objects (Llama 3.1/3.2).
    # Empty: "auto" is a 400; "none", "required" and a named function work with every model.
    tool_call_parser: Literal["", "hermes", "llama3_json"] = ""
    # A reasoning model's thinking (<think>...</think>) returned apart as reasoning_content
    # (vLLM's --reasoning-parser): "deepseek_r1" (the output starts inside the thinking),
    # "qwen3" (the output opens it itself); empty: all text is content.
    reasoning_parser: Literal["", "deepseek_r1", "qwen3"] = ""

    @property
    def api_key_list(self) -> list[str]:
        return [k.strip() for k in self.api_keys.split(",") if k.strip()]


class SpeculativeSettings(MeshSettings):
    """Speculative decoding, read by the scheduler (K lookahead slots) and the worker (the
    drafter). Empty method = off."""

    spec_method: Literal["", "ngram", "draft", "eagle", "eagle3", "mtp", "dflash"] = ""
    spec_tokens: int = Field(4, ge=1, le=64)  # K: drafts verified per request and step
    # With async scheduling: the worker verifies its own drafts in lookahead slots, so verify
    # steps are planned ahead (docs/step-pipeline.md); false: drafts go worker -> scheduler ->
    # worker and each verify step waits for the previous result (grammar requests always do).
    spec_drafts_on_worker: bool = True
    # The draft model's / EAGLE head's / DFlash draft's path ("draft", "eagle", "eagle3",
    # "dflash"); "mtp" reads the MTP layers of the served model's own checkpoint (default:
    # MESHLLM_MODEL's directory).
    spec_model: str = ""


class SchedulerSettings(CommonSettings, ModelSettings, SpeculativeSettings, SchedulingSettings):
    port: int = 8001
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # per-step token budget (chunked prefill)
    # At most this many prompt tokens of one request per step (vLLM's
    # --long-prefill-token-threshold); 0 = no cap. A long prefill then takes several steps and
    # leaves room in each for others: a request whose prompt is mostly cached is not kept
    # waiting a whole long prefill's step for its first token.
    long_prefill_token_threshold: int = Field(0, ge=0)
    enable_prefix_caching: bool = True
    step_timeout_s: float = 60.0  # a worker silent this long during a step is declared dead
    # Plan step N+1 while the worker runs step N (the worker feeds its sampled tokens forward).
    async_scheduling: bool = True
    # With async scheduling, plans out at once: 2 = the step running and the next one (vLLM's
    # and SGLang's depth); 3 also plans the one after, so the result -> plan round trip
    # (scheduler, both bus hops, the worker's finish and launch) has two steps to hide in
    # instead of one: at large batches that round trip can outlast a step, and the device then
    # waits for each plan; small batches run at the same speed with 2 or 3 (docs/
    # decode-on-h200.md). A request that stops on eos computes up to two discarded positions.
    schedule_ahead: int = Field(3, ge=2, le=3)
    worker_ready_timeout_s: float = 600.0
    # A request whose gateway sent no heartbeat for this long is aborted (nobody reads its
    # tokens); counted only while Redis answers. 0 = never.
    gateway_timeout_s: float = Field(30.0, ge=0)
    # Structured outputs with a reasoning model: token ids of the markers that end / start its
    # reasoning (e.g. `</think>` / `<think>`; JSON lists). Empty end marker = no reasoning
    # parser: the grammar applies from the first output token.
    reasoning_end_token_ids: list[int] = Field(default_factory=list)
    reasoning_start_token_ids: list[int] = Field(default_factory=list)
    structured_outputs_enable_in_reasoning: bool = False  # constrain the reasoning too
    # KV offload tier (services/scheduler/offload): the kvstore is called over the bus, so
    # this switch alone turns it on; off by default, as a mesh need not run a kvstore. A
    # kvstore that is down or slow degrades to recompute, never an error.
    kv_offload: bool = False
    kvstore_timeout_s: float = Field(2.0, gt=0)  # one kvstore call
    kvstore_retry_s: float = Field(5.0, ge=0)  # after a failed call, skip the kvstore this long
    # A request whose prefix chunk is being written to the tier by another request waits (is
    # asked again each step) at most this long for the write to land, then recomputes it.
    kv_pending_write_wait_s: float = Field(2.0, ge=0)
    # Which KV chunks are written to the tier (services/scheduler/offload/store_admission.py):
    # "reuse" = a chunk a second request offers (store on second sight), "always" = every full
    # block of every request. A prefill-role scheduler always stores.
    kv_store_policy: Literal["reuse", "always"] = "reuse"
    # The tier's load rate (bytes/s) assumed until loads measured it: a hit is loaded only when
    # that beats recomputing it (services/scheduler/offload/load_cost.py).
    kv_load_bytes_per_s: float = Field(200e6, gt=0)
    # Prefill/decode disaggregation (services/scheduler/pd): "prefill" computes prompts, stores
    # their KV through the offload tier and hands requests to a "decode" scheduler; "both"
    # serves requests whole. Prefill and decode need the offload tier (kv_offload).
    role: Literal["both", "prefill", "decode"] = "both"
    # Prompt tokens the prefill side leaves to the decode side besides the last one (the one
    # prefill-lookahead number, CONTRACTS.md: the max of this and the drafter's backoff).
    prefill_lookahead_tokens: int = Field(0, ge=0)
    # KV-aware routing: a full snapshot of the prefix blocks held goes on the kvevents stream
    # this often (between snapshots, per-step stored/removed batches), so a gateway that
    # starts or missed events knows the group again within this time.
    kv_snapshot_interval_s: float = Field(10.0, gt=0)
    # Request migration: the output tokens of running requests are checkpointed this often
    # (services/scheduler/progress_book.py), so a scheduler taking a request over after a
    # fault continues from them instead of its prompt (resume.py). 0 = off (from the prompt).
    progress_checkpoint_s: float = Field(1.0, ge=0)


class WorkerSettings(CommonSettings, ModelSettings, SpeculativeSettings):
    port: int = 8002
    kv_cache_bytes: int = 0  # 0 = kv_cache_memory_fraction of free memory
    kv_cache_memory_fraction: float = 0.3
    # Hybrid models (attention + Mamba2 layers): the state pool's blocks out of the KV cache
    # budget (services/worker/runner/state_pool.py): MESHLLM_KV_STATE_BLOCKS if > 0, else
    # max(a floor for max_num_seqs running requests and one step of max_num_batched_tokens,
    # kv_state_memory_share of the budget), at most 0.9 of it; attention gets the rest.
    kv_state_blocks: int = Field(0, ge=0)
    kv_state_memory_share: float = Field(0.5, ge=0, le=0.9)
    # The scheduler's batch bounds (the same MESHLLM_MAX_NUM_SEQS and
    # MESHLLM_MAX_NUM_BATCHED_TOKENS): what the state pool's floor provides for.
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    # "dummy": random weights at the shapes of MESHLLM_MODEL's config.json, no weight files read
    # (vLLM's --load-format dummy): benchmarks of large shapes behind the gateway, which still
    # needs the directory's tokenizer. "auto": the checkpoint's weights.
    load_format: Literal["auto", "dummy"] = "auto"
    num_threads: int = 0  # torch intra-op threads; 0 = auto on CPU (services/worker/cpu_threads)
    # Launch step N+1 while step N still runs on the device (its sampled tokens fed forward on
    # the device; services/worker/runner/in_flight.py). "auto": on for CUDA, off on CPU, where a
    # step is computed while it is launched and holding its result back would only add latency.
    overlap_steps: Literal["auto", "on", "off"] = "auto"
    # n-gram speculation: verify steps planned ahead run from the device's copy of each row's
    # tokens (drafts, inputs and acceptance on the device: services/worker/spec/chain.py), so
    # they overlap like decode steps. "auto": on for CUDA (with its verify graphs), off on CPU.
    spec_device_chain: Literal["auto", "on", "off"] = "auto"
    # CUDA: steps of up to this many tokens run the Triton GEMV and the decode chain
    # (services/worker/accel/cuda_layers.py), larger ones cuBLAS. 16: the batches its tiles were
    # tuned for on the H200; up to 128 to compare the two at 17-128 rows (bench/RESULTS.md).
    gemv_max_rows: int = Field(16, ge=1, le=128)
    # CUDA: attention of fresh prompt spans (no cached prefix) in one dense call instead of the
    # paged Triton kernel (services/worker/attention/dense_prefill.py): "auto" flash-attention
    # varlen (else SDPA); "sdpa" SDPA per run of equal-length spans (cuDNN on the H100: up to
    # 2.4x faster, but ~70 ms of host time at each new prompt length: fixed-shape workloads
    # only); "flash-varlen" that one; "off" the paged kernel.
    dense_prefill: Literal["auto", "sdpa", "flash-varlen", "off"] = "auto"
    # CUDA: prefill and mixed steps of up to this many tokens replay CUDA graphs too
    # (services/worker/accel/prefill_graphs.py; 0 = eager). For small models, whose eager
    # forward is launch-bound (SmolLM2: ~15 ms a prefill step on the H200 against ~1.2 ms a
    # decode step from its graph); a large model's launches hide behind its GPU work.
    prefill_graph_tokens: int = Field(0, ge=0)
    # CUDA: decode steps replay captured CUDA graphs (services/worker/accel/cuda_graphs.py);
    # true runs every step eagerly (vLLM's --enforce-eager: debugging, graph-vs-eager timing).
    enforce_eager: bool = False
    # CUDA warm-up: Triton compiles the kernels it must have before serving in this many
    # threads (meshllm_kernels/parallel_compile.py); 0 = the CPUs available, at most 16;
    # 1 = one by one as launched.
    kernel_compile_threads: int = Field(0, ge=0)
    # Compile the forward with torch.compile on CPU (services/worker/accel/cpu_compile.py). "auto":
    # on where supported (bf16, dense models, no speculative decoding); start-up then takes
    # tens of seconds longer. "on" is "auto" that also logs why it cannot compile a model.
    cpu_compile: Literal["auto", "on", "off"] = "auto"
    # Decode attention on CPU (meshllm_kernels/attention/cpu_decode.py): "auto" = the C++ kernel
    # where a compiler builds it, else PyTorch; "kernel" = the kernel or fail; "torch" = PyTorch.
    cpu_attention: Literal["auto", "kernel", "torch"] = "auto"
    # Entries in each of oneDNN's per-shape caches (services/worker/onednn_caches.py): bf16 CPU
    # linears compile a primitive per token count, ~0.3 MB each; the libraries' default of 1,024
    # let the worker's RSS creep for hours.
    onednn_cache_entries: int = Field(128, ge=1)
    # KV offload data path (services/worker/kv_offload): stores and loads the scheduler asks for.
    kv_offload: bool = True
    kv_host_tier_bytes: int = Field(256 * 2**20, ge=0)  # host-memory LRU in front of Redis
    kv_staging_bytes: int = Field(64 * 2**20, ge=0)  # store staging slots (pinned on CUDA)
    kv_offload_timeout_s: float = Field(5.0, gt=0)  # Redis socket timeout of the transfer threads
    # The share of wall time the store thread may spend writing to Redis: it rests in proportion
    # after each round trip, so stores never take more of the machine than this; a backlog
    # waits in staging, and stores that find staging full are dropped (never waited for).
    kv_store_max_busy_share: float = Field(0.5, gt=0, le=1)
    # A JSON line per step with its host and device times (services/worker/runner/
    # step_timeline.py; read by `python -m services.worker.runner.step_timeline_report`);
    # "" = off.
    step_timeline: str = ""
    # Tensor parallelism (services/worker/parallel): the worker group runs this many ranks, one
    # process each (one GPU each on CUDA); the worker process is rank 0 and starts the others.
    # Each rank holds 1/tp of the weights and of the KV heads (kv_cache_bytes is per rank).
    tp: int = Field(1, ge=1)
    # Bound on every collective between the ranks: a rank that died takes the group down
    # within it instead of hanging the others.
    tp_timeout_s: float = Field(60.0, gt=0)


class GrammarSettings(CommonSettings, ModelSettings):
    port: int = 8003
    cache_entries: int = 512
    compile_timeout_s: float = 10.0
    compile_workers: int = 2  # compiler processes (each compiles one grammar at a time)
    compile_threads: int = 1  # xgrammar threads per compilation
    compile_memory_mb: int = 2048  # address space a compilation may add before it is refused
    cache_ttl_s: int = 7 * 86400  # compiled grammars in Redis; refreshed on every use
    max_compiled_bytes: int = 64 * 2**20  # larger serialized grammars are refused
    # JSON outputs: "compact" (fixed `, ` and `: ` separators) or "any" whitespace (vLLM's
    # default; small models then tend to loop on newlines).
    json_whitespace: Literal["compact", "any"] = "compact"


class KVStoreSettings(CommonSettings):
    port: int = 8004
    capacity_bytes: int = 2 * 1024**3
    policy: str = "services.kvstore.lru.LRUPolicy"
    # A chunk write not reported within this time of its step's end (the scheduler's `writing`
    # call) failed (its worker died): dropped, and its payload deleted.
    write_timeout_s: float = Field(60.0, gt=0)
    # The same for a write whose step never reported ending (its scheduler died mid-step): the
    # deadline then runs from the `store` call and must outlast any forward.
    write_start_timeout_s: float = Field(900.0, gt=0)
