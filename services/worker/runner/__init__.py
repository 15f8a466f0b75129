"""One worker step and what it keeps between steps: runner, persistent batch, KV cache."""
