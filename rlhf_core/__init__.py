"""rlhf_core: the library (no Kubernetes or Kubeflow knowledge lives here)."""
