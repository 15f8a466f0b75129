"""A request body -> a validated, tokenized RequestPlan (grammar compiled over the bus)."""
