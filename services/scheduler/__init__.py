"""The scheduler: the engine core of one worker group, and its bus edge.

Reading order:
- `kv/` bottom-up: `kv_cache_spec` -> `block_pool` -> `single_type_manager` ->
  `kv_cache_coordinator` -> `kv_cache_manager` (prefix lookup, admission estimates that equal
  allocations); block hashes are shared with the kvstore and worker (shared/kv);
- `request`, `stop`, `routed_experts`, `waiting_queue` (fcfs or priority order) -> `scheduler`
  (queues, admission, chunked prefill, preemption; StepPlans out, StepResults in) ->
  `scheduler_output`; `config`;
- `spec/` (lookahead slots, draft bookkeeping), `structured_output/` (grammar matchers run
  in-process), `offload/` (the KV offload tier: pure `connector` and its I/O `edge`, with the
  kvstore client), `pd/` (prefill/decode disaggregation, pure core and `edge`);
- `submit_check` (what a SubmitRequest may not carry), `gateway_watch` (whose gateway is
  gone), `peer_groups` (which other groups' request streams to look after), `kv_report` (the
  KVEvents gateways route by, from the block pool's `kv/kv_event_log`), `progress_book`
  (which progress checkpoints to write: a running request's output tokens) and `resume`
  (whether a request taken over after a fault continues from its checkpoint), all pure;
  `intake` (the requests held, from bus entry to ack, poison dead-lettered), `progress_edge`
  (the checkpoints' Redis hash) and `service` (the worker and the step loop): the bus edge
  around all of it. Only `service`, `intake`, `progress_edge`, `offload/edge`, `pd/edge`,
  `offload/kvstore_client` and `structured_output/grammar_loader` do I/O.

Request migration: a request whose group died (or whose scheduler restarted) is taken over
from its bus entry by another scheduler (intake, peer_groups) and continues from the output
tokens its previous runner checkpointed (at most `progress_checkpoint_s` old; the few tokens
after it are regenerated identically and dropped by the gateway), so the client's stream goes
on with nothing lost or repeated. Metrics: `meshllm:scheduler_requests_resumed_total{from=
"checkpoint"|"prompt"}` and `meshllm:scheduler_resumed_skipped_tokens` (tokens not generated
again). A request moves at most `max_deliveries` times; past that it fails with an error.
"""
