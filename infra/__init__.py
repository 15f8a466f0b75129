"""Deployment: Dockerfile, local launcher, Redis configuration and ACLs."""
