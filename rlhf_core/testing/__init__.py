"""Helpers for tests and benchmarks (local S3 server)."""
