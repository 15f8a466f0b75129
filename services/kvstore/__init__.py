"""kvstore service."""
