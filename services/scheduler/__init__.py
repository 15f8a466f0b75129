"""The scheduler: the engine core of one worker group, and its bus edge.

Reading order:
- `kv/` bottom-up: `kv_cache_spec` -> `block_pool` -> `single_type_manager` ->
  `kv_cache_coordinator` -> `kv_cache_manager` (prefix lookup, admission estimates that equal
  allocations); block hashes are shared with the kvstore and worker (shared/kv);
- `request`, `stop`, `routed_experts` -> `scheduler` (queues, admission, chunked prefill,
  preemption; StepPlans out, StepResults in) -> `scheduler_output`; `config`;
- `spec/` (lookahead slots, draft bookkeeping), `structured_output/` (grammar matchers run
  in-process), `offload/` (the KV offload tier: pure `connector` and its I/O `edge`, with the
  kvstore client), `pd/` (prefill/decode disaggregation, pure core and `edge`);
- `submit_check` (what a SubmitRequest may not carry), `gateway_watch` (whose gateway is
  gone), `peer_groups` (which other groups' request streams to look after), `kv_report` (the
  KVEvents gateways route by, from the block pool's `kv/kv_event_log`), all pure;
  `intake` (the requests held, from bus entry to ack, poison dead-lettered)
  and `service` (the worker and the step loop): the bus edge around all of it. Only `service`,
  `intake`, `offload/edge`, `pd/edge`, `offload/kvstore_client` and
  `structured_output/grammar_loader` do I/O.
"""
