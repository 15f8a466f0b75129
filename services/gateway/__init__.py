"""The gateway: meshllm's OpenAI-compatible REST API.

Reads top-down: `protocol_openai` (request bodies) -> `request_plan` (tokenize, validate, build
SubmitRequests) -> `bus_client` (submit, replies, aborts) -> `choice_assembler` (detokenize,
stop strings, logprobs) -> `responses` (JSON bodies and SSE chunks) -> `routes` (HTTP edge) ->
`service` (wiring).
"""
