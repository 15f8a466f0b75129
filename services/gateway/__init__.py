"""The gateway: meshllm's OpenAI-compatible REST API.

Reads top-down:
- `protocol_openai` (request bodies) -> `request_plan` (with `validation`, `tokenization`,
  `sampling_params`, `structured_outputs`): a validated, tokenized plan;
- `bus_client` (submit, replies de-duplicated by `reply_dedup`, aborts, backpressure);
- `generation` drives one request: `choice_assembler` (with `detokenizer`, `stop_strings`)
  per choice, `responses` for JSON bodies and SSE chunks, `metrics`;
- the edge: `frontend` (the parts held together), `routes` (HTTP, `auth`), `service`.
"""
