"""Models built on this machine: the built-in task's model and Qwen2 from a config."""
