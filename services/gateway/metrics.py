"""Request metrics with vLLM's names, prefixed `meshllm:` (dashboards translate by prefix).

Observed per scheduler request (per choice), like vLLM, labelled by the served model name:
- time_to_first_token_seconds: arrival -> first output token;
- inter_token_latency_seconds: between consecutive token arrivals (a delta with k tokens after
  a gap g counts k gaps of g/k: speculative decoding delivers several tokens at once);
  arrival is when the HTTP request came in, before tokenization;
- e2e_request_latency_seconds, request_prompt_tokens, request_generation_tokens and
  request_success_total{finished_reason} once the choice ends (a client that went away or a
  timeout counts as "abort"; an engine error is not a success and is not counted).
"""

from __future__ import annotations

import time

from prometheus_client import Counter, Histogram

from shared.metrics import metric_name

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)

TIME_TO_FIRST_TOKEN = Histogram(
    metric_name("time_to_first_token_seconds"),
    "Time to the first output token",
    ["model_name"],
    buckets=_LATENCY_BUCKETS,
)
INTER_TOKEN_LATENCY = Histogram(
    metric_name("inter_token_latency_seconds"),
    "Time between output tokens",
    ["model_name"],
    buckets=_LATENCY_BUCKETS,
)
E2E_REQUEST_LATENCY = Histogram(
    metric_name("e2e_request_latency_seconds"),
    "Arrival to the last output token",
    ["model_name"],
    buckets=_LATENCY_BUCKETS,
)
REQUEST_PROMPT_TOKENS = Histogram(
    metric_name("request_prompt_tokens"),
    "Prompt tokens per finished request",
    ["model_name"],
    buckets=_TOKEN_BUCKETS,
)
REQUEST_GENERATION_TOKENS = Histogram(
    metric_name("request_generation_tokens"),
    "Generated tokens per finished request",
    ["model_name"],
    buckets=_TOKEN_BUCKETS,
)
REQUEST_SUCCESS = Counter(
    metric_name("request_success"),
    "Finished requests by finish reason",
    ["model_name", "finished_reason"],
)


class ChoiceTimer:
    """Latency bookkeeping of one choice (one scheduler request)."""

    def __init__(self, model_name: str, prompt_tokens: int, arrival: float | None = None) -> None:
        self.model_name = model_name
        self.prompt_tokens = prompt_tokens
        self.arrival = time.monotonic() if arrival is None else arrival
        self._last: float | None = None
        self._done = False
        # Looked up once: `labels()` takes a lock and a dict lookup, and a stream asks per token.
        self._itl = INTER_TOKEN_LATENCY.labels(model_name)

    def tokens(self, count: int) -> None:
        """`count` tokens arrived now. The first arrival gives the TTFT; tokens that came with
        the first one have no gap of their own and are not counted as inter-token latency."""
        if count <= 0:
            return
        now = time.monotonic()
        if self._last is None:
            TIME_TO_FIRST_TOKEN.labels(self.model_name).observe(now - self.arrival)
        else:
            gap = (now - self._last) / count
            for _ in range(count):
                self._itl.observe(gap)
        self._last = now

    def finished(self, finish_reason: str, generated_tokens: int) -> None:
        if self._done:
            return
        self._done = True
        E2E_REQUEST_LATENCY.labels(self.model_name).observe(time.monotonic() - self.arrival)
        REQUEST_PROMPT_TOKENS.labels(self.model_name).observe(self.prompt_tokens)
        REQUEST_GENERATION_TOKENS.labels(self.model_name).observe(generated_tokens)
        REQUEST_SUCCESS.labels(self.model_name, finish_reason).inc()
