"""The gateway: meshllm's OpenAI-compatible REST API, in front of the mesh.

Reading order, one request top-down:
- `api/`: the HTTP edge. `protocol_openai` (request bodies), `routes` (the endpoints, with
  `auth`), `body_limits` (size and nesting bounds, before a body is parsed), `errors` (OpenAI's
  error body), `responses` (JSON bodies and SSE chunks, with `logprobs_format`),
  `responses_api` / `responses_output` (the Responses API, translated to and from the chat
  path), `openapi_bodies` (what /openapi.json documents);
- `plan/`: a raw body becomes a validated, tokenized `RequestPlan`: `planner` (per endpoint,
  run by `planning_pool`: inline for small bodies, in worker processes for large ones),
  `request_plan` (with `validation`, `tokenization`, `model_info`, `sampling_params`,
  `structured_outputs`, `tool_choice`, `bad_words`) and `grammar_client` (the grammar service,
  asked before anything is queued);
- `stream/`: the plan on the bus and its answer: `bus_client` (submit, replies, aborts,
  backpressure, with `reply_dedup`), `generation` (one request in flight) and per choice
  `choice_assembler` (with `detokenizer`, `stop_strings`) and, for a chat with reasoning or
  tools in play, `message_reader` (with `reasoning`, `tool_calls`); `responses_events` turns a
  chat stream's chunks into the Responses API's events;
- `mesh/`: which worker groups can serve, learned from the heartbeat stream: `groups` (the
  view: /ready and the 503 while none is ready, each group's load) fed by `heartbeat_reader`;
- `route/`: which group takes a request: `kv_index` (prefix blocks per group, fed by
  `kv_events_reader`) and `router` (kv / least_load / round_robin, 429 past the queue bounds),
  with `metrics`; `frontend.destination` puts mesh and router together;
- `frontend` holds the parts together for the routes; `metrics`; `service` (wiring).
"""
