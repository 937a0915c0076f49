"""Kubeflow components: thin wrappers over rlhf_core."""
