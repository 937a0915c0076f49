"""Pipeline definitions (compiled YAML lives beside them)."""
