"""Which attention runs: `select` (the entry point), `reference`, `dense_prefill`, metadata."""
