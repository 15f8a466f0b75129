"""grammar service."""
