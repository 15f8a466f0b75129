"""Redis configuration and per-service ACL users."""
