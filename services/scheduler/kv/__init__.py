"""The scheduler's KV cache manager: spec -> pool -> per-group managers -> coordinator."""
